"""Throughput and gateway overhead with 1, 2 and 3 gateway replicas: `sluice bench scale-out`.

The implementation is `sluice/experiments/scale_out.py` (packaged, so the command works from an
installed sluice too); this script runs it from a checkout:

    PYTHONPATH=. python bench/scale_out.py --replicas 1,2,3 --postgres-url postgresql://postgres@127.0.0.1:5432/test \
        --redis-url redis://127.0.0.1:6379/0 --json docs/lab/results/scale-out.json
"""

from __future__ import annotations

import sys

from sluice.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "scale-out", *sys.argv[1:]]))
