"""bench/gpu_suite.py --dry-run runs every section at tiny sizes and reports passing checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kernels, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_completes_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_suite.py"), "--dry-run", "--skip-hf", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "=== gpu_suite summary ===" in proc.stdout
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert report["ceilings"]["copy_GBps"] > 0 and report["ceilings"]["matmul_TFLOPs"] > 0
    checks = [r for r in report["rows"] if r["section"] == "check"]
    assert len(checks) >= 8 and all(r["ok"] for r in checks)
    timed = [r for r in report["rows"] if r["section"] == "kernel"]
    assert timed and all(r["ms"] > 0 for r in timed)
    assert any(r["section"] == "engine" for r in report["rows"])


def test_gpu_slo_dry_run_writes_every_arm_and_phase(tmp_path: Path) -> None:
    """bench/gpu_slo.py (issue #32's experiment for a lent GPU) end to end on a tiny model on CPU."""
    env = {**os.environ}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_slo.py"), "--dry-run", "--out", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "slo_gpu.json").read_text())
    assert set(summary["arms"]) == {"fixed-16", "fixed-64", "adaptive", "adaptive-p95"}
    assert all(len(phases) == 4 for phases in summary["arms"].values())
    assert summary["verdict"]["adaptive_p95_over_best_single_fixed"] is not None
    assert (tmp_path / "slo_gpu.png").is_file()


def test_gpu_slo_refuses_bad_chunks_with_one_line() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_slo.py"), "--dry-run", "--chunks", "0,x"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("expected comma-separated integers, got '0,x'")
