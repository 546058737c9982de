"""`sluice bench engine` smoke run at a tiny size: one JSON report with every section filled."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from sluice.cli import main
from sluice_lab.engine_bench import POLICIES, schedule_and_update, steady_decode_scheduler
from sluice_lab.loadgen.prompts import LengthDist

pytestmark = pytest.mark.integration


def test_bench_engine_writes_report(tmp_path: Path, demo_model_dir: Path) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "engine", "--model", str(demo_model_dir), "--json", str(out), "--no-kernel-build",
                 "--num-requests", "4", "--workloads", "random",
                 "--prompt-len", "uniform:4:20", "--output-len", "fixed:3", "--hf-batch-sizes", "2,4",
                 "--policies", "chunked,static", "--scheduler-sizes", "4", "--max-model-len", "128",
                 "--num-kv-blocks", "32", "--latency-prompt-len", "20",
                 "--latency-output-len", "16", "--latency-streams", "1,3"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["hf_static"]["output_tokens"] == 12 and report["hf_static"]["output_tokens_per_s"] > 0
    by_batch = report["hf_static_by_batch"]
    assert set(by_batch) == {"2", "4"}
    best = max(by_batch.values(), key=lambda r: r["output_tokens_per_s"])
    assert report["hf_static"]["batch_size"] == best["batch_size"]
    assert set(report["sluice"]) == {"chunked", "static"}
    for policy, result in report["sluice"].items():
        assert result["output_tokens"] == 12
        assert result["cpu_seconds"] > 0
        assert result["output_tokens_per_cpu_s"] == pytest.approx(12 / result["cpu_seconds"])
        assert report["speedup_vs_hf"][policy] == pytest.approx(
            result["output_tokens_per_s"] / report["hf_static"]["output_tokens_per_s"])
    assert report["scheduler_cpu_ms_per_step"]["4"] >= 0
    assert report["matmul_peak"]["gflops"] > 0
    assert set(report["sluice"]["chunked"]["latency"]) == {"streams_1", "streams_3"}
    assert report["sluice"]["chunked"]["fraction_of_matmul_peak"] > 0
    # A latency point's ITL is the difference of two timed runs (the whole answer, its first token):
    # on a tiny model and a busy host it can come out at or below zero, so only its presence is checked.
    assert math.isfinite(report["hf_static"]["latency"]["streams_1"]["mean_itl_s"])
    assert report["workload"] == "random" and report["scenarios"] == {}


def test_chat_workload_is_rendered_sampled_and_long_tailed(tmp_path: Path, demo_model_dir: Path) -> None:
    """The default workload: shipped conversations through the chat template, sampled with a seed
    per request, output lengths from the long-tailed default; speculation on and off side by side."""
    from sluice_lab.engine_bench import DEFAULT_OUTPUT_LEN
    from sluice_lab.workloads import load_conversations, make_workload

    conversations, domains = load_conversations()
    assert len(conversations) >= 40 and {"code", "translation", "support", "math", "writing"} <= set(domains)
    assert any(len(c) > 3 for c in conversations)  # multi-turn
    workload = make_workload("chat", demo_model_dir, 64, 3, LengthDist.parse("fixed:4"),
                             LengthDist.parse(DEFAULT_OUTPUT_LEN), 100)
    again = make_workload("chat", demo_model_dir, 64, 3, LengthDist.parse("fixed:4"),
                          LengthDist.parse(DEFAULT_OUTPUT_LEN), 100)
    assert workload == again  # a function of the seed
    lengths = sorted(o for _, o in workload.requests)
    assert lengths[-1] > 3 * lengths[len(lengths) // 2]  # long-tailed
    params = workload.sampling_params()
    assert {p.temperature for p in params} == {0.8} and {p.top_p for p in params} == {0.95}
    assert len({p.seed for p in params}) == len(params) and all(p.ignore_eos for p in params)
    # Requests sharing the long support-handbook system context share a long prompt prefix.
    prompts = [p for p, _ in workload.requests]
    assert max(len(p) for p in prompts) > 4 * sorted(len(p) for p in prompts)[len(prompts) // 2]

    out = tmp_path / "chat.json"
    code = main(["bench", "engine", "--model", str(demo_model_dir), "--json", str(out), "--no-kernel-build",
                 "--num-requests", "3", "--output-len", "fixed:5", "--skip-hf", "--also-speculation-off",
                 "--policies", "chunked", "--scheduler-sizes", "4", "--latency-output-len", "4",
                 "--latency-streams", "1"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "chat" and set(report["scenarios"]) == {"random"}
    assert set(report["sluice"]) == {"chunked", "chunked spec-off"}
    assert report["sluice"]["chunked spec-off"]["speculative_tokens"] == 0
    assert math.isfinite(report["sluice"]["chunked spec-off"]["latency"]["streams_1"]["mean_itl_s"])
    assert all(r["output_tokens"] == 15 for r in report["scenarios"]["random"]["sluice"].values())


def test_length_distributions() -> None:
    rng = random.Random(0)
    assert [LengthDist.parse("fixed:7").sample(rng) for _ in range(3)] == [7, 7, 7]
    assert all(5 <= LengthDist.parse("uniform:5:9").sample(rng) <= 9 for _ in range(50))
    tail = [LengthDist.parse("lognormal:20:1.0:4:300").sample(rng) for _ in range(500)]
    assert min(tail) >= 4 and max(tail) <= 300 and max(tail) > 5 * sorted(tail)[250]  # long-tailed
    assert LengthDist.parse("lognormal:20:0.5").high == 1_000_000


@pytest.mark.parametrize("spec", ["uniform:9:5", "fixed:0", "fixed:2.5", "normal:3:10", "lognormal:0:1",
                                  "lognormal:10:-1", "lognormal:10:1:5", "lognormal:10:1:9:3", "lognormal:10:1:2.5:9",
                                  "uniform:a:b", ""])
def test_bad_length_distribution_is_one_cli_line(spec: str, demo_model_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "engine", "--model", str(demo_model_dir), "--output-len", spec])
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sluice: error:")]
    assert len(errors) == 1 and "bad length distribution" in errors[0]  # after argparse's usage lines


@pytest.mark.parametrize("flag", ["--hf-batch-sizes", "--scheduler-sizes"])
def test_bad_size_lists_are_one_cli_line(flag: str, demo_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "engine", "--model", str(demo_model_dir), flag, "8,0", "--skip-hf"])
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sluice: error:")]
    assert len(errors) == 1 and flag in errors[0]  # after argparse's usage lines


@pytest.mark.parametrize(("flag", "message"), [("--peer-speculative-tokens", "--peer-speculative-tokens must be"),
                                              ("--speculative-tokens", "num_speculative_tokens must be")])
def test_bad_speculation_flags_are_one_cli_line(flag: str, message: str, demo_model_dir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "engine", "--model", str(demo_model_dir), flag, "-1", "--skip-hf"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_scheduler_timing_runs_decodes(policy: str) -> None:
    """The steps the scheduler timing measures are pure decode steps of every running request."""
    scheduler = steady_decode_scheduler(8, policy, steps=5)
    for k in range(5):
        out = schedule_and_update(scheduler, 100.0 + k)
        assert len(out.chunks) == 8 and all(chunk.is_decode for chunk in out.chunks)
        assert not out.preempted_ids


def test_missing_peer_venv_is_one_cli_line(tmp_path: Path, demo_model_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "engine", "--model", str(demo_model_dir), "--peer", "vllm", "--workloads", "random",
                 "--peer-venv", str(tmp_path / "nowhere"), "--skip-hf"])
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "make bench-peers" in err[0] and str(tmp_path / "nowhere") in err[0]


def test_useful_flops_counts_weights_attention_and_head(demo_model_dir: Path) -> None:
    from sluice.workers.model.config import ModelConfig
    from sluice_lab.peer import gemm_shapes, useful_flops

    cfg = ModelConfig.from_dir(demo_model_dir)
    layer = sum(k * n for name, (k, n) in gemm_shapes(cfg).items() if name != "lm_head")
    # One prompt token, one output: one token through the layers (1 key), one head evaluation.
    expected = 2 * cfg.num_layers * layer + 2 * cfg.hidden_size * cfg.vocab_size \
        + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    assert useful_flops(cfg, [([5], 1)]) == expected


@pytest.mark.parametrize("workloads", ["chat,nope", "", "chat,chat"])
def test_bad_workloads_are_one_cli_line(workloads: str, demo_model_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "engine", "--model", str(demo_model_dir), "--workloads", workloads, "--skip-hf"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--workloads" in err[0]
