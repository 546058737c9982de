"""`vllm bench serve` (vLLM's own client, from PyPI, unmodified) against sluice: every request of
a chat and a completions run succeeds (issue #35). vLLM's client reads each SSE event as one
`data:` line, which sluice sends unless the client opts in to resumable ids (docs/streams.md).

Needs the vLLM virtualenv of `make bench-peers` (.peers/vllm, or $SLUICE_PEERS_DIR/vllm): skipped
without it. The gateway is the package's real one over HTTP with the demo model; vLLM's client
loads the demo model's tokenizer from its directory.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sluice_lab.experiments.vllm_parity import BENCH_SERVE

REPO = Path(__file__).resolve().parents[3]
VLLM = Path(os.environ.get("SLUICE_PEERS_DIR") or REPO / ".peers") / "vllm" / "bin" / "python"
NUM_PROMPTS = 12

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM.exists(), reason=f"no vLLM client at {VLLM} (make bench-peers)"),
]


@pytest.mark.parametrize(("backend", "endpoint"), [("openai", "/v1/completions"),
                                                    ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_reads_every_stream(gateway, demo_model_dir: Path, tmp_path: Path, backend: str,
                                             endpoint: str) -> None:
    _, key = gateway.tenant()
    command = [str(VLLM), "-c", BENCH_SERVE, "--backend", backend, "--base-url", gateway.base_url,
               "--endpoint", endpoint, "--model", "demo", "--tokenizer", str(demo_model_dir),
               "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8",
               "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--ignore-eos",
               "--disable-tqdm", "--ready-check-timeout-sec", "0", "--save-result", "--save-detailed",
               "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    env = dict(os.environ, OPENAI_API_KEY=key, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               PYTHONPATH="")  # vLLM's own environment: nothing of sluice's on its path
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    errors = [e for e in result.get("errors", []) if e]
    assert result["completed"] == NUM_PROMPTS and not errors, errors[:3]
    assert result["total_output_tokens"] == NUM_PROMPTS * 8
