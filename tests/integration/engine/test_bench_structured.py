"""`sluice bench structured` at a tiny size on the demo model: one JSON report with every section,
and a missing vLLM peer refused in one CLI line before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]


def test_bench_structured_writes_report(tmp_path: Path, demo_model_dir: Path) -> None:
    out = tmp_path / "structured.json"
    code = main(["bench", "structured", "--model", str(demo_model_dir), "--json", str(out), "--no-kernel-build",
                 "--num-requests", "4", "--rounds", "1", "--max-tokens", "12", "--threads", "1",
                 "--max-model-len", "512", "--num-kv-blocks", "64"])
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["arms"]) == {"0%", "50%", "100%"}
    # Every arm generated the same tokens: the unconstrained twins take the constrained lengths.
    tokens = {arm["output_tokens"] for arm in report["arms"].values()}
    assert len(tokens) == 1 and tokens.pop() > 0
    assert report["arms"]["100%"]["mask_fill_ms_per_masked_step"] > 0
    assert report["arms"]["0%"]["mask_fill_ms_per_masked_step"] is None  # no constrained row, no mask
    assert set(report["mask_cost_ms_per_step"]) == {"1", "16", "64"}
    assert all(cost["fill_ms"] > 0 and cost["apply_ms"] > 0 for cost in report["mask_cost_ms_per_step"].values())
    assert report["compile"]["cold_compile_ms"] > report["compile"]["warm_compile_ms"] > 0
    assert report["ratio_100_vs_0"] > 0 and "peers" not in report


def test_missing_peer_venv_is_one_cli_line(tmp_path: Path, demo_model_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "structured", "--model", str(demo_model_dir), "--peer", "vllm",
                 "--peer-venv", str(tmp_path / "nowhere"), "--json", str(tmp_path / "s.json")])
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "make bench-peers" in err[0] and str(tmp_path / "nowhere") in err[0]
    assert not (tmp_path / "s.json").exists()
