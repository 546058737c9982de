"""Where sluice's gateway spends its CPU in front of an upstream: py-spy under closed-loop load.

Starts the fake backend and `sluice serve` with an `[[upstreams]]` entry for it (the same set-up
as `sluice bench gateway-overhead --upstream fake`, same placement), drives `--streams` closed-loop
streams for `--seconds`, and records the gateway process with py-spy meanwhile. Writes py-spy's
raw collapsed stacks and prints the top frames by own time and by inclusive time.

    python bench/profile_upstream_gateway.py --py-spy /path/to/py-spy --streams 50 --seconds 15
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sluice.experiments import overhead_procs as procs
from sluice.experiments.common import resolve_model
from sluice.experiments.upstream_overhead import MODEL, request_body
from sluice.loadgen.lean_client import Target, closed_loop, run_loop


def summarize(collapsed: Path, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    lines = [f"{total} samples", "", "own time:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines += ["", "inclusive:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--py-spy", default="py-spy")
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--out", default="gateway-profile.txt", help="collapsed stacks")
    parser.add_argument("--config-dir", default="config")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    placement = procs.Placement.for_cores(sorted(os.sched_getaffinity(0)))
    procs.pin_self(placement.client)
    with tempfile.TemporaryDirectory(prefix="sluice-profile-") as tmp:
        workdir = Path(tmp)
        backend = procs.start_fake(workdir, placement.backend, ttft_ms=50, itl_ms=20, tokens=32)
        try:
            with procs.start_sluice_upstream(args.config_dir, workdir, placement.gateway, backend.url, MODEL,
                                             resolve_model(None), args.streams + 16) as stack:
                key = stack.create_tenant_key("profile", ceiling="interactive", default_class="interactive",
                                              quotas={"requests_per_minute": 10_000_000})
                target = Target("127.0.0.1", int(stack.base_url.rsplit(":", 1)[1]), "/v1/chat/completions",
                                request_body(32), (("Authorization", f"Bearer {key}"),))
                run_loop(closed_loop(target, 4, requests=16))  # warm-up
                spy = subprocess.Popen([args.py_spy, "record", "--pid", str(stack.process.pid), "--format", "raw",
                                        "--rate", str(args.rate), "--duration", str(int(args.seconds)),
                                        "--output", args.out, "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                results, wall = run_loop(closed_loop(target, args.streams, duration_s=args.seconds))
                spy.wait(timeout=60)
                ok = sum(1 for r in results if r.ok)
                print(f"{ok}/{len(results)} ok in {wall:.1f} s ({ok / wall:.1f} req/s) at {args.streams} streams")
        finally:
            backend.stop()
    if spy.returncode != 0:
        print(f"py-spy failed: {spy.stderr.read() if spy.stderr else ''}", file=sys.stderr)
        return 1
    print(summarize(Path(args.out), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
