"""An independent OpenAI-compatible server (HF transformers + http.server) in its own process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVER = Path(__file__).with_name("hf_openai_server.py")


@pytest.fixture(scope="module")
def hf_server_url(demo_model_dir: Path) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(SERVER), str(demo_model_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the model is loaded and the port is bound
        if not line.startswith("PORT "):
            raise RuntimeError(f"the HF test server did not start (exit {proc.poll()}): {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
