"""bench/batch_invariance.py answers bad arguments with a one-line error and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "batch_invariance.py"


@pytest.mark.parametrize("args", [["--model", "/nonexistent/model"], ["--model", "x", "--max-tokens", "many"],
                                  ["--model", "x", "--max-tokens", "0"], ["--model", "x", "--threads", "-1"], []])
def test_bad_arguments_are_one_line(args: list[str], tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "error:" in last and "Traceback" not in done.stderr
