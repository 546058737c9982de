"""Greedy token ids from our engine equal HF `generate` on a real LLM (SmolLM2-135M-Instruct).

float32 on the CPU, 16 chat-templated prompts of mixed lengths (the longest several times the
prefill chunk, four sharing a long prefix, multi-turn conversations that extend each other, one
repeated), 64 new tokens each, under every policy. One engine per policy runs them twice with a
KV pool small enough to force preemptions; the second pass is served largely from the prefix
cache. The HF reference (ids plus each position's top logits' gaps) is read from tests/data/hf-greedy
where it was recorded with the installed transformers and torch, else computed once per test run
and shared by the xdist workers (`hf_greedy`; SLUICE_TEST_RECORD_HF=1 records it).

A differing position is accepted only as a float near-tie: the engine's token must be one of HF's
best few whose logit is within NEAR_TIE_LOGIT_GAP of HF's best there (references stored before the
best few were kept: HF's runner-up, with the top-2 gap under it); the rest of that sequence is then
not comparable (its context differs) and the test says so in a warning. Anything else fails.
bfloat16 is compared the same way with HF's model in bfloat16, under a margin sized to bf16's
rounding (BF16_NEAR_TIE_LOGIT_GAP).

CI runs every policy on the small pool (preemptions) with a second pass over the prompts that
share prefixes (prefix-cache hits), and bfloat16 on half the prompts for 32 tokens. The full set
(second pass over all 16 prompts, two more pool shapes: a roomy pool with an odd chunk size, and a
pool that holds one sequence; bfloat16 on every prompt for 64 tokens) is one command:
`SLUICE_FULL_EXACTNESS=1 pytest tests/integration/engine/test_real_model_exactness.py`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import pytest

from sluice.protocol import SamplingParams
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine

# The HF reference alone is ~1,000 decode steps of a 30-layer model; on a loaded 2-core machine
# that is minutes, so these tests get more than the suite's default timeout.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_NEW_TOKENS = 64
POLICIES = ("chunked", "prefill_first", "static")
# float32 sums taken in another order (batched GEMMs, paged attention) move a logit of this
# model by ~1e-5..1e-4; a gap under 2e-3 is a tie that rounding may break either way.
NEAR_TIE_LOGIT_GAP = 2e-3
MAX_NEAR_TIES = 2  # more than this many is a bug, not rounding
CORPUS = (Path(__file__).resolve().parents[3] / "src" / "sluice" / "workers" / "demo_corpus.txt").read_text()
FULL = os.environ.get("SLUICE_FULL_EXACTNESS") == "1"
SECOND_PASS = range(8, 16)  # the shared document, the multi-turn chain and the repeat: prefix hits


def _conversations() -> list[list[dict[str, str]]]:
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    assistant = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    system = {"role": "system", "content": "You are a careful assistant. Answer briefly and precisely."}
    document = "Read this text.\n\n" + CORPUS[:1400]
    turn1 = [system, user("What does a sluice gate do?"), assistant("It controls the flow of water.")]
    turn2 = [*turn1, user("And what is a serving system like?"), assistant("It decides who goes first.")]
    convs = [
        [user("What is the capital of France? Answer in one sentence.")],
        [user("hi")],
        [user("List three prime numbers.")],
        [user("Write a haiku about the sea.")],
        [user("Translate 'good morning' into Spanish and German.")],
        [user("Summarize in one sentence:\n" + CORPUS[:400])],
        [user("What is the main idea of this text?\n" + CORPUS[400:1200])],
        [user("Give the text a title.\n" + CORPUS[1200:3400])],  # several chunks long
        [system, user(document), user("Who keeps the notebook?")],  # four prompts share this prefix
        [system, user(document), user("What moves from the basin into the canal?")],
        [system, user(document), user("Write one question about the text.")],
        [system, user(document)],
        [*turn1, user("Why?")],  # multi-turn conversations that extend one another
        [*turn2, user("Give an example.")],
        [*turn2, user("Give an example."), assistant("A chat request before a nightly batch."), user("Why?")],
    ]
    convs.append(convs[6])  # an exact repeat
    return convs


@pytest.fixture(scope="module")
def prompts(real_model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(real_model_dir))
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
            for c in _conversations()]


def test_prompts_cover_what_the_exactness_rule_needs(prompts: list[list[int]]) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 16 and lengths[0] < 48 and 4 * 64 < lengths[-1] <= 800 - MAX_NEW_TOKENS
    assert sum(length > 64 for length in lengths) >= 6  # beyond the prefill chunk


def _compare(label: str, got: list[list[int]], references, near_tie_gap: float = NEAR_TIE_LOGIT_GAP,
             max_near_ties: int = MAX_NEAR_TIES) -> None:
    ties, failures = [], []
    for i, (ids, ref) in enumerate(zip(got, references, strict=True)):
        if ids == ref.token_ids:
            continue
        common = min(len(ids), len(ref.token_ids))
        pos = next((k for k in range(common) if ids[k] != ref.token_ids[k]), common)
        if pos < common and ref.near_tie(pos, ids[pos], near_tie_gap):
            ties.append(f"prompt {i} position {pos}: top-2 logit gap {ref.gaps[pos]:.2e} (HF {ref.token_ids[pos]}, "
                        f"engine {ids[pos]}); later tokens not compared")
        else:
            gap = ref.gaps[pos] if pos < len(ref.gaps) else float("nan")
            failures.append(f"prompt {i} differs at position {pos} (HF top-2 gap {gap:.3g}): "
                            f"engine {ids[pos:pos + 8]} vs HF {ref.token_ids[pos:pos + 8]}")
    assert not failures, f"{label}: " + "; ".join(failures)
    assert len(ties) <= max_near_ties, f"{label}: too many near-ties: " + "; ".join(ties)
    if ties:
        warnings.warn(f"{label}: accepted float near-ties: " + "; ".join(ties), stacklevel=2)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, sampling)]


CONFIGS = {
    # 56 blocks of 16 = 896 tokens for 16 sequences of up to 759 (695 + 64): constant preemption.
    "small-pool": dict(block_size=16, max_prefill_chunk=64, max_num_batched_tokens=128, max_num_seqs=8,
                       num_kv_blocks=56, max_model_len=800),
}
if FULL:
    CONFIGS["roomy-odd-chunk"] = dict(block_size=16, max_prefill_chunk=17, max_num_batched_tokens=80,
                                      max_num_seqs=16, num_kv_blocks=1024, max_model_len=800)
    CONFIGS["one-sequence-pool"] = dict(block_size=32, max_prefill_chunk=128, max_num_batched_tokens=256,
                                        max_num_seqs=4, num_kv_blocks=26, max_model_len=800)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("policy", POLICIES)
def test_real_model_greedy_matches_hf(policy: str, config: str, real_model_dir: Path, prompts: list[list[int]],
                                      hf_greedy) -> None:
    references = hf_greedy(real_model_dir, prompts, MAX_NEW_TOKENS, persist=True)
    engine = LLMEngine(EngineConfig(model=str(real_model_dir), policy=policy, dtype="float32", **CONFIGS[config]))
    _compare(f"{policy}/{config} first pass", _run(engine, prompts), references)
    hits_before = engine.scheduler.stats.prefix_hit_tokens
    again = range(len(prompts)) if FULL else SECOND_PASS
    _compare(f"{policy}/{config} second pass", _run(engine, [prompts[i] for i in again]),
             [references[i] for i in again])
    assert engine.scheduler.stats.prefix_hit_tokens > hits_before  # served partly from the prefix cache
    if policy != "static" and config == "small-pool":  # static admits a batch only when it fits
        assert engine.scheduler.stats.num_preemptions > 0


def test_real_model_greedy_matches_hf_with_adaptive_chunks(real_model_dir: Path, prompts: list[list[int]],
                                                           hf_greedy) -> None:
    """The adaptive chunk policy under an ITL target no step meets: prefill held at an odd floor while
    streams decode, the whole budget otherwise; chunk boundaries move, greedy output must not."""
    references = hf_greedy(real_model_dir, prompts, MAX_NEW_TOKENS, persist=True)
    engine = LLMEngine(EngineConfig(model=str(real_model_dir), policy="chunked", dtype="float32",
                                    chunk_policy="adaptive", min_prefill_chunk=29, **CONFIGS["small-pool"]))
    sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for label, indices in (("first pass", range(len(prompts))), ("second pass", SECOND_PASS)):
        got = [r.token_ids for r in engine.generate([prompts[i] for i in indices], sampling, itl_target_s=1e-6)]
        _compare(f"adaptive/small-pool {label}", got, [references[i] for i in indices])
    assert engine.scheduler.stats.num_itl_capped_steps > 0


# bfloat16 (an engine dtype for CPUs with AVX512-BF16 / AMX, where oneDNN's bf16 GEMMs run several
# times faster than float32) is checked against HF's model loaded in bfloat16, not against float32.
# A bf16 logit near 20 is rounded to a multiple of 1/8, and the two implementations round
# intermediate results in different places (GEMM blocking, float32 accumulators cast back, the
# attention's float32 softmax), so a tie here is any choice within a few such steps of HF's best
# (HF's top-2 gap is often 0: a three- or four-way tie). Over 64 tokens most prompts meet one such
# tie (13 of 16 in the first run, at gaps of 0 to 0.25, first divergence at position 0 to 36), and
# after it the sequences part, so every prompt may end its comparison at one; a divergence at a
# wider gap (a real error: a wrong rotary or norm moves logits by whole units) still fails.
BF16_NEAR_TIE_LOGIT_GAP = 0.5
# A subset of the prompts (short, long, several chunks, shared prefixes, multi-turn) and the first
# BF16_TOKENS of each answer (a greedy answer's prefix is the greedy answer to fewer tokens): on a
# CPU without bf16 units each bf16 step is dear, and most comparisons end at a tie by then anyway.
BF16_PROMPTS = range(16) if FULL else (0, 1, 5, 7, 8, 9, 13, 14)
BF16_TOKENS = MAX_NEW_TOKENS if FULL else 32
BF16_POOL = dict(block_size=16, max_prefill_chunk=256, max_num_batched_tokens=512, max_num_seqs=16,
                 num_kv_blocks=800, max_model_len=800)


def test_real_model_bf16_greedy_matches_hf_in_bf16(real_model_dir: Path, prompts: list[list[int]],
                                                   hf_greedy) -> None:
    import torch

    recorded = hf_greedy(real_model_dir, prompts, MAX_NEW_TOKENS, persist=True, dtype=torch.bfloat16)
    references = [_first(recorded[i], BF16_TOKENS) for i in BF16_PROMPTS]
    # Every prompt at once in a roomy pool: bf16 is what this test is about (preemption and chunking
    # are the float32 tests' part), and on a CPU without bf16 units each recomputed step is dear.
    engine = LLMEngine(EngineConfig(model=str(real_model_dir), policy="chunked", dtype="bfloat16",
                                    **BF16_POOL))
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    sampling = SamplingParams(max_tokens=BF16_TOKENS, temperature=0.0, ignore_eos=True)
    got = [r.token_ids for r in engine.generate([prompts[i] for i in BF16_PROMPTS], sampling)]
    _compare("bfloat16 chunked/roomy", got, references, BF16_NEAR_TIE_LOGIT_GAP, max_near_ties=len(references))


def _first(reference, tokens: int):  # type: ignore[no-untyped-def]  # a conftest Reference
    """HF's greedy answer cut to its first `tokens` tokens."""
    return dataclasses.replace(reference, token_ids=reference.token_ids[:tokens],
                               runner_up_ids=reference.runner_up_ids[:tokens], gaps=reference.gaps[:tokens],
                               top_ids=reference.top_ids[:tokens], top_gaps=reference.top_gaps[:tokens])
