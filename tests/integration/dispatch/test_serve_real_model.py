"""A plain `sluice serve` with the shipped config serves the real SmolLM2 model by default, and
the curl and openai snippets it prints get a real answer, through Kafka and a worker process.

The model directory comes from the shared `real_model_dir` fixture (placed where the shipped
models.toml looks for it), so the test does not download it a second time.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sluice.broker import free_port

from .conftest import REPO
from .test_serve import Serve, serve_environment

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _printed(serve: Serve, timeout: float = 240) -> str:
    """serve's output once it has printed its try-it snippets."""
    deadline = time.monotonic() + timeout
    log = Path(serve.log.name)
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "print(reply.choices[0].message.content)\nEOF" in text:
            return text
        if serve.process.poll() is not None:
            raise AssertionError(f"serve exited with {serve.process.returncode}:\n{text}")
        time.sleep(0.2)
    raise AssertionError("serve printed no snippets in time")


def test_plain_serve_answers_with_the_real_model(tmp_path: Path, real_model_dir: Path, bootstrap_servers: str) -> None:
    shutil.copytree(REPO / "config", tmp_path / "config")
    (tmp_path / "var" / "models").mkdir(parents=True)
    (tmp_path / "var" / "models" / "smollm2-135m-instruct").symlink_to(real_model_dir)
    port = free_port()
    serve = Serve(tmp_path, serve_environment(tmp_path, tmp_path / "config", bootstrap_servers, "real"), port)
    try:
        serve.wait_ready(timeout=300)
        printed = _printed(serve)
        workers = serve.admin("GET", "/admin/workers").json()["workers"]
        assert [w["models"] for w in workers] == [["smollm2-135m-instruct"]], workers  # the demo is not served
        curl = re.search(r"^curl -N .*?-d '.*?'$", printed, flags=re.MULTILINE | re.DOTALL)
        assert curl is not None, printed
        streamed = subprocess.run(["bash", "-c", curl.group(0)], capture_output=True, text=True, timeout=300)
        assert streamed.returncode == 0, streamed.stderr
        deltas = re.findall(r'"content":"([^"]*)"', streamed.stdout)
        assert "Paris" in "".join(deltas), streamed.stdout
        snippet = re.search(r"^python - <<'EOF'\n(.*?)\nEOF$", printed, flags=re.MULTILINE | re.DOTALL)
        assert snippet is not None, printed
        answer = subprocess.run([sys.executable, "-c", snippet.group(1)], capture_output=True, text=True,
                                timeout=300)
        assert answer.returncode == 0, answer.stderr
        assert "Paris" in answer.stdout, answer.stdout
    finally:
        assert serve.stop() == 0
