"""`sluice bench engine` smoke run at a tiny size: one JSON report with every section filled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.cli import main
from sluice.workers.bench_engine import LengthDist, scheduler_step_cpu_ms

pytestmark = pytest.mark.integration


def test_bench_engine_writes_report(tmp_path: Path, demo_model_dir: Path) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "engine", "--model", str(demo_model_dir), "--json", str(out), "--num-requests", "4",
                 "--prompt-len", "uniform:4:20", "--output-len", "fixed:3", "--hf-batch-size", "2",
                 "--policies", "chunked,static", "--scheduler-sizes", "4", "--max-model-len", "128",
                 "--num-kv-blocks", "32"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["hf_static"]["output_tokens"] == 12 and report["hf_static"]["output_tokens_per_s"] > 0
    assert set(report["sluice"]) == {"chunked", "static"}
    for policy, result in report["sluice"].items():
        assert result["output_tokens"] == 12
        assert report["speedup_vs_hf"][policy] == pytest.approx(
            result["output_tokens_per_s"] / report["hf_static"]["output_tokens_per_s"])
    assert report["scheduler_cpu_ms_per_step"]["4"] >= 0


def test_length_distributions() -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    assert LengthDist.parse("fixed:7").sample(3, gen) == [7, 7, 7]
    assert all(5 <= n <= 9 for n in LengthDist.parse("uniform:5:9").sample(50, gen))
    assert all(n >= 1 for n in LengthDist.parse("normal:3:10").sample(50, gen))
    with pytest.raises(Exception, match="bad length distribution"):
        LengthDist.parse("uniform:9:5")


def test_scheduler_timing_runs_decodes() -> None:
    assert scheduler_step_cpu_ms(8, steps=5) >= 0
