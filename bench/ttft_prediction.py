"""The gateway's TTFT prediction against the TTFT clients see (issue #32), through the whole stack:
`sluice serve` with a model, a tenant whose requests are interactive (TTFT target 3 s), and the chat
scenario (src/sluice_lab/scenarios/chat.toml) for 60 s at a chosen rate. The load generator reads
each answer's X-Sluice-Predicted-TTFT-Ms and its report prints |predicted - observed| / observed.

  .venv/bin/python bench/ttft_prediction.py ~/.cache/sluice/smollm2-135m-instruct 0.7 out.json
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from sluice_lab.experiments.stack import start_stack

ROOT = Path(__file__).resolve().parent.parent


def main(model: Path, rate: float, out: Path) -> int:
    work = Path(tempfile.mkdtemp(prefix="ttft-prediction-"))
    with start_stack(ROOT / "config", work, model) as stack:
        key = stack.create_tenant_key("chat", ceiling="interactive", default_class="interactive")
        scenario = (ROOT / "src" / "sluice_lab" / "scenarios" / "chat.toml").read_text()
        for old, new in (('model = "demo"', f'model = "{stack.model}"'), ("duration_s = 30", "duration_s = 60"),
                         ('api_key_env = "SLUICE_BENCH_KEY_CHAT"', f'api_key = "{key}"'),
                         ("rate = 2.0", f"rate = {rate}")):
            if old not in scenario:
                raise SystemExit(f"chat.toml no longer holds {old!r}")
            scenario = scenario.replace(old, new)
        path = work / "chat.toml"
        path.write_text(scenario)
        return subprocess.run([sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "bench", "serve",
                               "--base-url", stack.base_url, "--scenario", str(path), "--json", str(out),
                               "--tokenizer", str(model), "--no-progress"], check=False).returncode


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: ttft_prediction.py MODEL_DIR RATE OUT.json")
    sys.exit(main(Path(sys.argv[1]).expanduser(), float(sys.argv[2]), Path(sys.argv[3])))
