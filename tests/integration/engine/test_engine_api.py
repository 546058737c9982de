"""LLMEngine API on the demo model: validation, deltas, abort, stop strings, seeds, capacity."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.protocol import FinishReason, SamplingParams
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(demo_model_dir), max_model_len=256, num_kv_blocks=64,
                                  max_num_batched_tokens=128, max_num_seqs=8))


def test_add_request_validation(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", "", GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="at most 255 prompt tokens"):
        engine.add_request("a", [20] * 300, GREEDY)
    with pytest.raises(ValueError, match="between 0 and"):
        engine.add_request("a", [10**6], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("a", "hi", SamplingParams(temperature=5.0))
    engine.add_request("dup", "hi", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hi", GREEDY)
    engine.abort("dup")
    while engine.has_work:
        engine.step()


def test_deltas_carry_tokens_text_and_times(engine: LLMEngine) -> None:
    engine.add_request("d", "The river", GREEDY)
    deltas = []
    while engine.has_work:
        deltas.extend(engine.step())
    assert [d.request_id for d in deltas] == ["d"] * 16
    assert all(len(d.token_ids) == 1 and len(d.token_times) == 1 for d in deltas)
    assert [d.finish_reason for d in deltas] == [None] * 15 + [FinishReason.LENGTH]
    last = deltas[-1]
    assert last.num_output_tokens == 16 and last.num_prompt_tokens == len(engine.tokenize("The river"))
    assert last.first_scheduled_time <= last.first_token_time <= last.token_times[0]
    text = "".join(d.text for d in deltas)
    ids = [t for d in deltas for t in d.token_ids]
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_abort_emits_final_delta_and_frees_blocks(engine: LLMEngine) -> None:
    free_before = engine.capacity("w").free_kv_blocks
    engine.add_request("keep", "The keeper writes", GREEDY)
    engine.add_request("drop", "The baker measures flour", GREEDY)
    engine.step()
    assert engine.capacity("w").num_running == 2
    assert engine.abort("drop")
    assert not engine.abort("drop")  # already gone
    finals = {}
    while engine.has_work:
        for d in engine.step():
            if d.finish_reason is not None:
                finals[d.request_id] = d
    assert finals["drop"].finish_reason == FinishReason.ABORT
    assert finals["keep"].finish_reason == FinishReason.LENGTH
    cap = engine.capacity("w")
    assert (cap.num_running, cap.num_waiting, cap.free_kv_blocks) == (0, 0, free_before)
    assert cap.total_kv_blocks == 64 and cap.max_num_seqs == 8


def test_stop_string_across_tokens_finishes_with_stop(engine: LLMEngine) -> None:
    [full] = engine.generate(["The sluice gate opens"], GREEDY)
    ids = full.token_ids
    # A stop string spanning tokens 4..6 of the greedy output, as decoded in context.
    head = engine.tokenizer.decode(ids[:4], skip_special_tokens=True)
    upto = engine.tokenizer.decode(ids[:7], skip_special_tokens=True)
    stop = upto[len(head):]
    assert stop.strip() and stop in full.text
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,))
    [stopped] = engine.generate(["The sluice gate opens"], params)
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.text == full.text[: full.text.index(stop)]
    assert len(stopped.token_ids) < 16
    assert engine.capacity("w").num_running == 0


def test_seeded_sampling_is_independent_of_batch(engine: LLMEngine) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    [alone] = engine.generate(["Questions and answers"], seeded)
    others = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    crowd = engine.generate(["Tokens are small", "Questions and answers", "A good answer"],
                            [others, seeded, others])
    assert crowd[1].token_ids == alone.token_ids
    [other_seed] = engine.generate(["Questions and answers"],
                                   SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=43,
                                                  ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids


def test_logprobs_reported_per_token(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True)
    [r] = engine.generate(["Numbers appear"], params)
    assert len(r.logprobs) == 5
    for tok, lp in zip(r.token_ids, r.logprobs, strict=True):
        assert lp.chosen.token_id == tok and len(lp.top) == 3
        assert lp.top[0].token_id == tok  # greedy picks the most likely token
        assert lp.chosen.logprob <= 0.0


def test_eos_finishes_with_stop(engine: LLMEngine) -> None:
    [probe] = engine.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # Treat the first greedy token as a stop token: the request ends there with reason stop.
    params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(probe.token_ids[0],))
    [r] = engine.generate(["Hello"], params)
    assert r.finish_reason == FinishReason.STOP and r.token_ids == probe.token_ids[:1]


def test_cpu_kv_pool_defaults_to_a_fraction_of_available_memory(demo_model_dir: Path) -> None:
    from sluice.workers.runner import ModelRunner, available_host_memory

    # A small fraction: the pool is that share of what the host has left after the weights.
    small = ModelRunner(EngineConfig(model=str(demo_model_dir), max_model_len=256, cpu_memory_utilization=0.001))
    per_block = small._bytes_per_block()
    expected = int(available_host_memory() * 0.001) // per_block
    assert abs(small.num_kv_blocks - expected) <= max(2, expected // 20)  # memory moves a little meanwhile
    # The whole host: capped at what max_num_seqs sequences of max_model_len tokens can fill.
    capped = ModelRunner(EngineConfig(model=str(demo_model_dir), max_model_len=256, max_num_seqs=4,
                                      cpu_memory_utilization=1.0))
    assert capped.num_kv_blocks == 4 * 256 // 16
    # An explicit byte budget still wins.
    fixed = ModelRunner(EngineConfig(model=str(demo_model_dir), kv_cache_bytes=64 * per_block))
    assert fixed.num_kv_blocks == 64


def test_reschedule_keeps_the_model_and_greedy_tokens(demo_model_dir: Path) -> None:
    """A rescheduled engine (what `sluice bench slo` runs each arm on) gives the tokens a fresh engine
    under the same settings gives; it takes scheduling settings only, and only while idle."""
    settings = dict(model=str(demo_model_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=8)
    prompts = [[20 + i] * (40 + 13 * i) for i in range(4)]
    fresh = LLMEngine(EngineConfig(**settings, max_num_batched_tokens=40, max_prefill_chunk=16))
    engine = LLMEngine(EngineConfig(**settings, max_num_batched_tokens=128))
    before = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    runner = engine.runner
    engine.reschedule(max_num_batched_tokens=40, max_prefill_chunk=16)
    assert engine.runner is runner and engine.scheduler.config.max_prefill_chunk == 16
    assert engine.scheduler.stats.num_steps == 0  # a fresh scheduler
    got = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    assert got == [r.token_ids for r in fresh.generate(prompts, GREEDY)] == before
    with pytest.raises(ValueError, match="not scheduling settings"):
        engine.reschedule(max_num_seqs=4)
    engine.add_request("busy", "hi", GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        engine.reschedule(max_prefill_chunk=8)
    engine.abort("busy")
    while engine.has_work:
        engine.step()
