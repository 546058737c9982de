"""Greedy token ids from our engine equal HF `generate` (each prompt alone, no padding).

float32 on the CPU, 18 prompts of mixed lengths (some longer than the prefill chunk, some
sharing a prefix, two repeated, two sharing one long enough to wait for), under every
scheduling policy, with chunks that split prompts inside a block, with a KV pool small enough
to force preemptions, and with prefix-cache hits (the same prompts run twice on one engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.protocol import SamplingParams
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 12
POLICIES = ("chunked", "prefill_first", "static")
MODELS = ("demo_model_dir", "tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir", "tiny_qwen3_dir")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)

    def rand(n: int) -> list[int]:
        return torch.randint(4, 512, (n,), generator=gen).tolist()

    shared = rand(40)  # a prefix longer than two blocks
    lengths = (3, 7, 16, 17, 24, 25, 33, 50, 71, 90)
    prompts = [rand(n) for n in lengths]
    prompts += [shared + rand(n) for n in (1, 9, 30)]
    prompts += [shared[:20] + rand(12)]
    prompts += [prompts[7], prompts[0]]  # exact repeats
    system = rand(80)  # long enough that the second waits for the first's prefill (scheduler.py)
    prompts += [system + rand(n) for n in (5, 20)]
    return prompts


@pytest.fixture(scope="session")
def hf_reference(hf_greedy):
    """model dir -> greedy continuations from HF generate, computed once per model."""
    return lambda model_dir: [r.token_ids for r in hf_greedy(model_dir, _prompts(), MAX_NEW_TOKENS)]


def _run(engine: LLMEngine) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate(_prompts(), sampling)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model_fixture", MODELS)
def test_greedy_matches_hf_with_chunks_and_prefix_hits(
    model_fixture: str, policy: str, request: pytest.FixtureRequest, hf_reference
) -> None:
    model_dir: Path = request.getfixturevalue(model_fixture)
    expected = hf_reference(model_dir)
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), policy=policy, block_size=16, max_prefill_chunk=24,
        max_num_batched_tokens=96, max_num_seqs=8, num_kv_blocks=96, max_model_len=128,
    ))
    assert _run(engine) == expected
    if policy == "chunked":
        assert engine.scheduler.stats.num_shared_prefix_waits > 0
    hits_before = engine.scheduler.stats.prefix_hit_tokens
    assert _run(engine) == expected  # second pass: served largely from the prefix cache
    assert engine.scheduler.stats.prefix_hit_tokens > hits_before


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model_fixture", MODELS)
def test_greedy_matches_hf_under_preemption(
    model_fixture: str, policy: str, request: pytest.FixtureRequest, hf_reference
) -> None:
    model_dir: Path = request.getfixturevalue(model_fixture)
    # 9 blocks of 16 = 144 tokens for 18 requests of up to 102 tokens each: constant preemption.
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), policy=policy, block_size=16, max_prefill_chunk=24,
        max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=9, max_model_len=128,
        enable_prefix_caching=policy != "static",
    ))
    assert _run(engine) == hf_reference(model_dir)
    if policy != "static":  # static admits a batch only when it fits, so it may never preempt
        assert engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("slow_share", [0.0, 0.5])
@pytest.mark.parametrize("model_fixture", MODELS)
def test_greedy_matches_hf_with_adaptive_chunks(model_fixture: str, slow_share: float, request: pytest.FixtureRequest,
                                                hf_reference) -> None:
    """The adaptive chunk policy moves chunk boundaries step by step (an ITL target no step meets
    holds prefill at an odd floor once the cost model has seen enough steps): output unchanged."""
    model_dir: Path = request.getfixturevalue(model_fixture)
    expected = hf_reference(model_dir)
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), policy="chunked", chunk_policy="adaptive", min_prefill_chunk=7, block_size=16,
        itl_slow_share=slow_share,  # 0.5: whole-budget steps between floor-sized ones
        max_num_batched_tokens=96, max_num_seqs=8, num_kv_blocks=96, max_model_len=128,
    ))
    sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the second pass: a fitted model, and prefix-cache hits
        assert [r.token_ids for r in engine.generate(_prompts(), sampling, itl_target_s=1e-6)] == expected
    assert engine.scheduler.cost_model.ready and engine.scheduler.stats.num_itl_capped_steps > 0
    reported = engine.capacity("w")  # what the worker's heartbeat carries to the gateway
    assert reported.step_cost == engine.scheduler.cost_model.coefficients and reported.step_cost_error is not None
