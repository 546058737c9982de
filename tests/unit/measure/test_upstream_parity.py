"""`sluice bench upstream-parity`'s verdict (sluice_lab/experiments/vllm_parity.py): medians over runs
each way, through-sluice against direct, and issue #35's bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_lab.experiments.vllm_parity import bench_serve_command, compare

pytestmark = pytest.mark.unit


def run(ttft50: float, ttft99: float, itl99: float, tput: float) -> dict[str, float]:
    return {"median_ttft_ms": ttft50, "p99_ttft_ms": ttft99, "p99_itl_ms": itl99, "output_throughput": tput}


def test_medians_ratios_and_bounds() -> None:
    direct = [run(100, 400, 50, 100), run(120, 500, 60, 90), run(110, 450, 55, 95)]
    close = [run(105, 500, 60, 93), run(115, 530, 58, 92), run(125, 540, 62, 94)]  # p99 TTFT 530 <= 1.1*450+50
    verdict = compare(direct, close)
    assert verdict["direct"]["p99_ttft_ms"] == 450 and verdict["sluice"]["output_throughput"] == 93
    assert verdict["output_throughput_ratio"] == pytest.approx(93 / 95, abs=1e-3)
    assert verdict["ttft_p50_delta_ms"] == 5 and verdict["ttft_p99_delta_ms"] == 80
    assert verdict["within_bounds"] is True
    assert verdict["paired_median_ratios"]["output_throughput"] == pytest.approx(0.989, abs=1e-3)  # 93/95, 92/90, 94/95
    assert compare(direct, [run(110, 450, 55, 90)] * 3)["within_bounds"] is False  # tok/s 0.947x
    assert compare(direct, [run(110, 560, 55, 95)] * 3)["within_bounds"] is False  # TTFT p99 > 1.1x + 50 ms
    assert compare(direct, [run(110, 450, 61, 95)] * 3)["within_bounds"] is False  # ITL p99 1.11x
    assert "within_bounds" not in compare(direct, [{"output_throughput": 1.0}])  # a run without figures


def test_the_client_is_vllm_s_own_on_the_random_dataset(tmp_path: Path) -> None:
    command = bench_serve_command(Path("/venv"), "http://h:1", "m", Path("/tok"), concurrency=8, num_prompts=40,
                                  input_len=128, output_len=32, seed=3, result=tmp_path / "r.json")
    assert command[0] == "/venv/bin/python" and "--ignore-eos" in command
    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--random-input-len") == "128" and value("--max-concurrency") == "8" and value("--seed") == "3"
    assert value("--result-filename") == "r.json" and value("--result-dir") == str(tmp_path)
