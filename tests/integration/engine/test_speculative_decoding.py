"""Prompt-lookup speculation changes no output: greedy tokens equal HF `generate`, and every kind
of request (seeded sampling, penalties, logprobs, stop strings, max_tokens) gets the same deltas
with speculation on as with it off, while drafts are both kept and rejected along the way.

The prompts repeat themselves (a phrase said three times, then a variation), so the lookup finds
drafts from the first decode on, and the tiny random models continue some of them and not others.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.protocol import SamplingParams
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 40
MODELS = ("demo_model_dir", "tiny_llama_dir", "tiny_qwen3_dir")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)

    def rand(n: int) -> list[int]:
        return torch.randint(4, 512, (n,), generator=gen).tolist()

    prompts = []
    for phrase_len, tail_len in ((3, 2), (5, 7), (8, 1), (2, 30), (12, 12), (6, 40)):
        phrase = rand(phrase_len)
        prompts.append(phrase * 3 + rand(tail_len) + phrase[: phrase_len // 2])
    prompts += [rand(20), rand(45)]  # nothing to look up at first
    return prompts


def _engine(model_dir: Path, policy: str, speculative: int, **overrides: object) -> LLMEngine:
    options: dict = dict(model=str(model_dir), policy=policy, block_size=16, max_prefill_chunk=24,
                         max_num_batched_tokens=96, max_num_seqs=8, num_kv_blocks=96, max_model_len=160,
                         num_speculative_tokens=speculative)
    options.update(overrides)
    return LLMEngine(EngineConfig(**options))


@pytest.mark.parametrize("policy", ["chunked", "prefill_first", "static"])
@pytest.mark.parametrize("model_fixture", MODELS)
def test_greedy_with_drafts_matches_hf(model_fixture: str, policy: str, request: pytest.FixtureRequest,
                                       hf_greedy) -> None:
    model_dir: Path = request.getfixturevalue(model_fixture)
    expected = [r.token_ids for r in hf_greedy(model_dir, _prompts(), MAX_NEW_TOKENS)]
    engine = _engine(model_dir, policy, speculative=4)
    sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in engine.generate(_prompts(), sampling)] == expected
    stats = engine.scheduler.stats
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens, "drafts were not both kept and rejected"
    # Fewer steps than one token per request per step would take.
    assert stats.num_steps < MAX_NEW_TOKENS * len(expected)


def test_greedy_with_drafts_under_preemption_matches_hf(demo_model_dir: Path, hf_greedy) -> None:
    expected = [r.token_ids for r in hf_greedy(demo_model_dir, _prompts(), MAX_NEW_TOKENS)]
    # 10 blocks of 16 for 8 requests of up to ~110 tokens: constant preemption and recompute.
    engine = _engine(demo_model_dir, "chunked", speculative=4, num_kv_blocks=10, max_num_batched_tokens=64)
    sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in engine.generate(_prompts(), sampling)] == expected
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.stats.num_accepted_draft_tokens > 0


SAMPLINGS = {
    "seeded": SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    "unseeded": SamplingParams(max_tokens=30, temperature=1.0, top_k=20, ignore_eos=True),
    "penalties": SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3,
                                presence_penalty=0.5, frequency_penalty=0.2, ignore_eos=True),
    "logprobs": SamplingParams(max_tokens=30, temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True),
    "max_tokens": SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
}


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_every_sampling_kind_gets_the_same_output_with_and_without_drafts(demo_model_dir: Path, kind: str) -> None:
    results = []
    for speculative in (0, 4):
        engine = _engine(demo_model_dir, "chunked", speculative, seed=3)
        results.append(engine.generate(_prompts(), SAMPLINGS[kind]))
    off, on = results
    for a, b in zip(off, on, strict=True):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert len(b.token_times) == len(b.token_ids)
        # The same tokens ranked the same; the values agree to float32 rounding (a draft's row is
        # computed in a batch of another shape than the one-token step that would have made it).
        assert len(b.logprobs) == len(a.logprobs) == (len(a.token_ids) if kind == "logprobs" else 0)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert y.chosen.token_id == x.chosen.token_id
            assert [t.token_id for t in y.top] == [t.token_id for t in x.top]
            assert y.chosen.logprob == pytest.approx(x.chosen.logprob, abs=1e-4)
            assert [t.logprob for t in y.top] == pytest.approx([t.logprob for t in x.top], abs=1e-4)


def test_a_stop_string_inside_kept_drafts_ends_the_output_where_it_would_without_them(
        demo_model_dir: Path) -> None:
    greedy = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    plain = _engine(demo_model_dir, "chunked", 0).generate(_prompts(), greedy)
    # A stop string from the middle of each request's own (repetitive) output.
    for prompt, result in zip(_prompts(), plain, strict=True):
        if len(result.text) < 12:
            continue
        stop = result.text[len(result.text) // 2: len(result.text) // 2 + 3]
        if not stop.strip():
            continue
        params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True, stop=(stop,))
        off, on = (_engine(demo_model_dir, "chunked", k).generate([prompt], params)[0] for k in (0, 4))
        assert (on.token_ids, on.text, on.finish_reason) == (off.token_ids, off.text, off.finish_reason)
        assert on.finish_reason is not None and on.finish_reason.value == "stop"


def test_seeded_chat_sampling_is_the_same_with_and_without_drafts_on_the_real_model(real_model_dir: Path) -> None:
    """The bench's chat workload (code and translation prompts, where drafts are found and some
    kept) at temperature 0.8 / top_p 0.95 with a seed per request: the candidate sampler
    (workers/candidates.py) and speculation's verification rows give the tokens one-token steps give."""
    from sluice_lab.loadgen.prompts import LengthDist
    from sluice_lab.workloads import make_workload

    prompts, params = [], []
    for name in ("code", "translation"):
        workload = make_workload(name, real_model_dir, 3, 5, LengthDist.parse("fixed:4"),
                                 LengthDist.parse("fixed:48"), 49152)
        prompts += [p for p, _ in workload.requests]
        params += workload.sampling_params()
    outputs, drafts = [], []
    for speculative in (0, 4):
        engine = LLMEngine(EngineConfig(model=str(real_model_dir), num_speculative_tokens=speculative,
                                        max_model_len=1024, num_kv_blocks=256))
        if engine.scheduler.prompt_lookup is not None:
            engine.scheduler.prompt_lookup.min_keep_chance = 0.0  # draft at every chance: many checks
            engine.scheduler.prompt_lookup.knee_rows = 0
        outputs.append([r.token_ids for r in engine.generate(prompts, params)])
        drafts.append((engine.scheduler.stats.num_draft_tokens, engine.scheduler.stats.num_accepted_draft_tokens))
    assert outputs[1] == outputs[0]
    assert all(len(t) == 48 for t in outputs[0])
    drafted, kept = drafts[1]
    assert 0 < kept < drafted
