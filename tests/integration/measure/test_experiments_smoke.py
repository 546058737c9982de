"""Engine-level experiments at tiny sizes (--quick): they run and write the documented JSON and a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "bench", *args],
                          capture_output=True, text=True, timeout=240)


def test_policies_quick(demo_model_dir: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "policies.json", tmp_path / "policies.png"
    proc = _run("policies", "--quick", "--model", str(demo_model_dir), "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert set(summary["policies"]) == {"static", "prefill_first", "chunked"}
    for key in ("stall_ratio_prefill_first_over_chunked", "ttft_ratio_chunked_over_prefill_first",
                "meets_target"):
        assert key in summary
    assert summary["stall_ratio_prefill_first_over_chunked"] > 0
    for row in summary["policies"].values():
        for key in ("long_prompt_ttft_s", "max_stall_s", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s",
                    "itl_p50_s", "itl_p95_s", "itl_p99_s", "throughput_tok_s"):
            assert row[key] is not None and row[key] > 0, key
        # Every request ran to its fixed length (ignore_eos): 3 streams x 32 + 4 long-prompt tokens.
        assert row["output_tokens"] == 3 * 32 + 4
    assert summary["load"]["long_arrives_after_stream_tokens"] == 8
    assert png.stat().st_size > 10_000
    assert "stall ratio" in proc.stdout


def test_chunk_sweep_quick(demo_model_dir: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    proc = _run("chunk-sweep", "--quick", "--chunks", "16,64", "--model", str(demo_model_dir),
                "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert summary["recommended_chunk"] in (16, 64)
    assert [p["chunk"] for p in summary["points"]] == [16, 64]
    for p in summary["points"]:
        for key in ("ttft_p95_s", "itl_p95_s", "max_stall_s", "throughput_tok_s", "goodput_rps"):
            assert p[key] is not None, key
    best = max(summary["points"], key=lambda p: p["goodput_rps"])
    assert best["goodput_rps"] == next(p for p in summary["points"]
                                       if p["chunk"] == summary["recommended_chunk"])["goodput_rps"]
    assert png.stat().st_size > 10_000


def test_slo_quick(demo_model_dir: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "slo.json", tmp_path / "slo.png"
    proc = _run("slo", "--quick", "--chunks", "16,64", "--slo", "ttft=500ms,itl=50ms", "--model", str(demo_model_dir),
                "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert list(summary["arms"]) == ["fixed-16", "fixed-64", "adaptive", "adaptive-p95"]
    for arm in summary["arms"].values():
        assert set(arm) == {"steady", "long_while_decoding", "batch_flood", "burst"}
        assert arm["batch_flood"]["batch_tokens_per_s"] > 0 and arm["batch_flood"]["good"] == 4
        for phase in ("steady", "long_while_decoding", "burst"):
            assert arm[phase]["interactive_itl_p95_s"] > 0 and arm[phase]["interactive_ttft_p95_s"] > 0
        median, p95 = arm["long_while_decoding"]["cost_model_error"]  # warmed up: the model reports its error
        assert 0 <= median <= p95
    verdict = summary["verdict"]
    assert verdict["best_single_fixed"] in ("fixed-16", "fixed-64") and verdict["adaptive_goodput_rps"] >= 0
    assert png.stat().st_size > 10_000
    assert "adaptive / best single fixed" in proc.stdout


def test_experiment_flags_are_validated() -> None:
    proc = _run("chunk-sweep", "--chunks", "64,abc")
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr
    proc = _run("slo", "--phases", "lunch")
    assert proc.returncode != 0 and "unknown phase" in proc.stderr
