"""Engine-level experiments at tiny sizes (--quick): they run and write the documented JSON and a PNG."""

from __future__ import annotations

import json
import random
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
    assert summary["load"]["workload"] == {"name": "chat", "temperature": 0.8, "top_p": 0.95}


def test_slo_phases_from_chat_prompts(demo_model_dir: Path) -> None:
    """`bench slo`'s default prompts: shipped conversations rendered by the chat template, made
    retrieval-style where a phase wants them longer, sampled with a seed per request; the
    `random` source keeps the original load's shape."""
    from sluice_lab.experiments.slo_bench import PHASES, Sizes, phase_requests
    from sluice_lab.loadgen.scenario import Slo
    from sluice_lab.workloads import ChatPrompts, RandomPrompts, chat_prompt_pool

    source, sizes, slo = ChatPrompts(demo_model_dir), Sizes(), Slo.parse("ttft=3s,itl=300ms")
    shipped = {tuple(ids) for ids in chat_prompt_pool(demo_model_dir, 0)}
    bounds = {"interactive": sizes.stream_prompt, "long": sizes.long_prompt, "batch": sizes.batch_prompt,
              "burst": sizes.burst_prompt}
    for phase in PHASES:
        requests = phase_requests(phase, sizes, slo, source, seed=1)
        shape = phase_requests(phase, sizes, slo, RandomPrompts(100), seed=1)
        assert [(r.request_id, r.max_tokens, r.after, r.ttft_target_s) for r in requests] == [
            (r.request_id, r.max_tokens, r.after, r.ttft_target_s) for r in shape]
        assert phase_requests(phase, sizes, slo, source, seed=1) == requests  # a function of the seed
        assert {(r.temperature, r.top_p) for r in requests} == {(0.8, 0.95)}
        assert len({r.seed for r in requests}) == len(requests)
        assert {(r.temperature, r.seed) for r in shape} == {(0.0, None)}
        for role in {r.role for r in requests}:
            prompts = [r.prompt_token_ids for r in requests if r.role == role]
            low, high = bounds[role]
            assert all(low <= len(p) <= high for p in prompts), (phase, role, [len(p) for p in prompts])
            assert len(set(prompts)) == len(prompts)  # no two requests of a role send the same prompt
    # Longer than any shipped conversation: a shipped one with reference text in its system message.
    long = phase_requests("long_while_decoding", sizes, slo, source, seed=1)[-1].prompt_token_ids
    assert long not in shipped
    text = source._tokenizer.decode(long)
    assert "Reference material:" in text and text.rstrip().endswith("assistant")
    # Shorter than any: the shortest conversation, whole.
    tiny = source.prompts(random.Random(0), (1, 2), 2)
    assert [tuple(p) for p in tiny] == [min(shipped, key=len)] * 2


def test_experiment_flags_are_validated() -> None:
    proc = _run("chunk-sweep", "--chunks", "64,abc")
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr
    proc = _run("slo", "--phases", "lunch")
    assert proc.returncode != 0 and "unknown phase" in proc.stderr
    proc = _run("slo", "--workload", "lunch")
    assert proc.returncode == 2 and "invalid choice: 'lunch'" in proc.stderr
