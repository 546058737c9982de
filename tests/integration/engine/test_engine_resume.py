"""Resumed requests (worker failover): an engine given prompt + the first k output tokens of a run
(`resume_token_ids`) goes on exactly as that run did: same token ids, same text deltas, same
finish reason and usage; for greedy and for seeded sampling; with stop strings.

The delta-by-delta checks run without speculation, so that each delta is one token and k indexes
deltas; with speculation a resumed run keeps other drafts than the first (its steps fall
elsewhere), and the last test checks that its tokens and text are still the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.protocol import FinishReason, RequestDelta, SamplingParams
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine

pytestmark = pytest.mark.integration

PROMPT = "The keeper writes the level"


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(demo_model_dir), max_model_len=256, num_kv_blocks=64,
                                  max_num_batched_tokens=128, max_num_seqs=8, num_speculative_tokens=0))


def run(engine: LLMEngine, rid: str, sampling: SamplingParams, resume: list[int] | None = None,
        ) -> list[RequestDelta]:
    engine.add_request(rid, PROMPT, sampling, resume_token_ids=resume or ())
    deltas = []
    while engine.has_work:
        deltas.extend(d for d in engine.step() if d.request_id == rid)
    return deltas


def check_resumes_as_undisturbed(engine: LLMEngine, sampling: SamplingParams, ks: list[int]) -> None:
    undisturbed = run(engine, "u", sampling)
    ids = [t for d in undisturbed for t in d.token_ids]
    assert all(len(d.token_ids) == 1 for d in undisturbed)  # one delta per token: k indexes deltas
    for k in ks:
        resumed = run(engine, f"r{k}", sampling, ids[:k])
        assert [d.token_ids for d in resumed] == [d.token_ids for d in undisturbed[k:]], k
        assert [d.text for d in resumed] == [d.text for d in undisturbed[k:]], k
        assert resumed[-1].finish_reason == undisturbed[-1].finish_reason
        assert resumed[-1].num_output_tokens == undisturbed[-1].num_output_tokens == len(ids)
        assert resumed[-1].num_prompt_tokens == undisturbed[-1].num_prompt_tokens
        assert [d.num_output_tokens for d in resumed] == list(range(k + 1, len(ids) + 1))
        assert all(len(d.token_times) == len(d.token_ids) == 1 for d in resumed)  # each token's time
        assert resumed[0].first_token_time == resumed[0].token_times[0]


def test_greedy_resume_continues_exactly(engine: LLMEngine) -> None:
    check_resumes_as_undisturbed(engine, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                                 [1, 7, 20, 39])


def test_seeded_sampled_resume_samples_the_same_tokens(engine: LLMEngine) -> None:
    sampling = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    [a] = engine.generate([PROMPT], sampling)
    [b] = engine.generate([PROMPT], SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=1235,
                                                   ignore_eos=True))
    assert a.token_ids != b.token_ids  # it really samples
    check_resumes_as_undisturbed(engine, sampling, [1, 13, 30])


def test_resume_with_penalties_and_stop_string(engine: LLMEngine) -> None:
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, frequency_penalty=0.5)
    [full] = engine.generate([PROMPT], plain)
    head = engine.tokenizer.decode(full.token_ids[:10], skip_special_tokens=True)
    upto = engine.tokenizer.decode(full.token_ids[:14], skip_special_tokens=True)
    stop = upto[len(head):]
    assert stop.strip() and stop in full.text
    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, frequency_penalty=0.5,
                              stop=(stop,))
    undisturbed = run(engine, "s", sampling)
    assert undisturbed[-1].finish_reason == FinishReason.STOP
    n = len(undisturbed)
    # Resumed before the stop string, and inside it (a prefix held back, never delivered).
    check_resumes_as_undisturbed(engine, sampling, [3, 10, 11, n - 1])


def test_resume_validation(engine: LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="resume token ids must be between 0 and"):
        engine.add_request("v", PROMPT, greedy, resume_token_ids=[10**6])
    with pytest.raises(ValueError, match="nothing to generate"):
        engine.add_request("v", PROMPT, greedy, resume_token_ids=[20] * 8)
    with pytest.raises(ValueError, match="at most 255"):
        engine.add_request("v", [20] * 200, SamplingParams(max_tokens=100), resume_token_ids=[20] * 60)
    eos = min(engine.eos_token_ids)
    with pytest.raises(ValueError, match="stop token"):
        engine.add_request("v", PROMPT, SamplingParams(max_tokens=8), resume_token_ids=[20, eos])
    with pytest.raises(ValueError, match="stop token"):
        engine.add_request("v", PROMPT, SamplingParams(max_tokens=8, stop_token_ids=(21,)),
                           resume_token_ids=[21])
    assert not engine.has_work  # nothing refused was queued
    engine.add_request("v", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), resume_token_ids=[eos])
    while engine.has_work:
        engine.step()


@pytest.mark.parametrize("seeded", [False, True])
def test_resume_with_speculation_gives_the_same_tokens_and_text(demo_model_dir: Path, seeded: bool) -> None:
    engine = LLMEngine(EngineConfig(model=str(demo_model_dir), max_model_len=256, num_kv_blocks=64,
                                    max_num_batched_tokens=128, max_num_seqs=8, num_speculative_tokens=4))
    sampling = (SamplingParams(max_tokens=60, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True) if seeded
                else SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    undisturbed = run(engine, "u", sampling)
    ids = [t for d in undisturbed for t in d.token_ids]
    text = "".join(d.text for d in undisturbed)
    assert engine.scheduler.stats.num_accepted_draft_tokens > 0 or seeded
    for k in (1, 17, 40):
        resumed = run(engine, f"r{k}", sampling, ids[:k])
        assert [t for d in resumed for t in d.token_ids] == ids[k:]
        resumed_text = "".join(d.text for d in resumed)
        assert resumed_text and text.endswith(resumed_text)  # it goes on where the first run was
        assert resumed[-1].num_output_tokens == len(ids) and resumed[-1].finish_reason == FinishReason.LENGTH
