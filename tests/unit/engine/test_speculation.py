"""Prompt-lookup speculation: the proposer, and how the scheduler drafts, verifies and limits.

Runner outputs are made by hand (no torch), as in test_scheduler.py.
"""

from __future__ import annotations

import random

import pytest

from sluice.workers.request import RequestStatus
from sluice.workers.scheduler import RunnerOutput, SchedulerOutput
from sluice.workers.speculative import MIN_KEEP_CHANCE, NgramIndex, Outcome, PromptLookup

from .test_scheduler import make, req, step

pytestmark = pytest.mark.unit

LOOP = [7, 8, 9, 10]


def _reference(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> tuple[int, ...]:
    """Brute force: the k tokens after the latest earlier occurrence of the longest suffix."""
    n_tokens = len(tokens)
    for n in range(min(lookup_max, n_tokens - 1), lookup_min - 1, -1):
        suffix = tokens[n_tokens - n:]
        for end in range(n_tokens - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tuple(tokens[end:end + k])
    return ()


# ---- the proposer --------------------------------------------------------------------------------


def test_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix() -> None:
    lookup = PromptLookup(3, 1, 4)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 6, 2, 3]
    # [2, 3] occurred twice; the latest (followed by 6, 2, 3) wins over the first (4, 5, 9).
    assert lookup.propose(NgramIndex(), tokens, limit=10) == (6, 2, 3)


def test_no_draft_without_an_earlier_occurrence() -> None:
    assert PromptLookup(4, 2, 4).propose(NgramIndex(), [1, 2, 3, 4, 5], limit=10) == ()
    assert PromptLookup(4, 1, 4).propose(NgramIndex(), [1], limit=10) == ()


def test_limit_and_length_cap_the_draft() -> None:
    tokens = LOOP * 3
    assert PromptLookup(4, 1, 4).propose(NgramIndex(), tokens, limit=2) == (7, 8)
    assert PromptLookup(4, 1, 4).propose(NgramIndex(), tokens, limit=0) == ()
    assert PromptLookup(0, 1, 4).propose(NgramIndex(), tokens, limit=9) == ()


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_agrees_with_a_scan(seed: int) -> None:
    rng = random.Random(seed)
    lookup_min, lookup_max = rng.choice([(1, 4), (2, 3), (1, 1), (3, 5)])
    lookup = PromptLookup(5, lookup_min, lookup_max)
    index = NgramIndex()
    tokens = [rng.randrange(4) for _ in range(3)]
    for _ in range(120):  # the index grows as the request does, between calls
        tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        assert lookup.propose(index, tokens, limit=5) == _reference(tokens, 5, lookup_min, lookup_max)


def test_a_long_prompt_is_indexed_over_its_last_tokens_only() -> None:
    lookup = PromptLookup(3, 2, 4)
    filler = list(range(1000, 6000))  # 5,000 distinct tokens
    early = [1, 2, 3, 4, *filler, 1, 2]  # [1, 2] occurred only beyond the lookback
    assert lookup.propose(NgramIndex(), early, limit=3) == ()
    late = [*filler, 1, 2, 3, 4, *filler[:100], 1, 2]
    assert lookup.propose(NgramIndex(), late, limit=3) == (3, 4, 1000)


def _verify(lookup: PromptLookup, index: NgramIndex, tokens: list[int], truth: list[int]) -> int:
    """One step for a request at `tokens` whose model would continue with `truth`: propose, then
    record what the runner would sample (the model's token at each row while the drafts before it
    held). Returns the number of drafts sent."""
    drafts = lookup.propose(index, tokens, limit=9)
    kept = 0
    while kept < len(drafts) and drafts[kept] == truth[kept]:
        kept += 1
    sampled = truth[:len(drafts) + 1]
    lookup.record(index, len(tokens), sampled, len(drafts), kept)
    return len(drafts)


def test_a_kind_of_guess_that_keeps_failing_is_cut_and_comes_back_when_it_holds() -> None:
    lookup = PromptLookup(4, 1, 4)
    tokens = LOOP * 4
    assert len(lookup.propose(NgramIndex(), tokens, limit=9)) == 4  # nothing learned yet: tried
    # The loop's guess (7, 8, 9, 10) keeps being wrong after its first token.
    for _ in range(20):
        _verify(lookup, NgramIndex(), tokens, [7, 1, 2, 3, 4])
    assert lookup.model.chance(Outcome.KEPT, 4, 0) > 0.9
    assert lookup.model.chance(Outcome.KEPT, 4, 1) < MIN_KEEP_CHANCE
    assert lookup.propose(NgramIndex(), tokens, limit=9) == (7,)
    # The token after the one draft is still checked, for free: when the loop holds again, the
    # second position earns its way back (a cut kind of guess is never stuck).
    sent = [_verify(lookup, NgramIndex(), tokens, [7, 8, 9, 10, 7]) for _ in range(40)]
    assert sent[0] == 1 and sent[-1] == 4


def test_the_bar_rises_with_the_batch() -> None:
    """A draft row pays when its chance of being kept beats the share of the step that grows with
    the rows: alone a coin flip is enough; beside 128 decodes a 3-in-4 guess is not, while the
    guesses of an unbroken loop (kept nearly always) still are."""
    lookup = PromptLookup(4, 1, 4)
    assert lookup.keep_chance_bar(1) == MIN_KEEP_CHANCE
    bars = [lookup.keep_chance_bar(n) for n in (1, 8, 32, 64, 128, 256)]
    assert bars == sorted(bars) and 0.9 < bars[4] < 0.99
    tokens = LOOP * 4
    # Nothing learned yet: every kind of guess is estimated at 3 in 4.
    assert len(lookup.propose(NgramIndex(), tokens, limit=9, batch_rows=1)) == 4
    assert lookup.propose(NgramIndex(), tokens, limit=9, batch_rows=128) == ()
    for _ in range(200):  # the loop holds: its guesses earn their rows even in a full batch
        _verify(lookup, NgramIndex(), tokens, [7, 8, 9, 10, 7])
    assert len(lookup.propose(NgramIndex(), tokens, limit=9, batch_rows=128)) == 4
    flat = PromptLookup(4, 1, 4, knee_rows=0)  # the bar off: the learned cut-off alone
    assert flat.keep_chance_bar(128) == MIN_KEEP_CHANCE


def test_the_previous_guess_s_fate_is_part_of_the_kind() -> None:
    lookup = PromptLookup(4, 1, 4)
    index = NgramIndex()
    tokens = LOOP * 4
    _verify(lookup, index, tokens, [7, 8, 5, 5, 5])
    assert index.outcome is Outcome.BROKEN
    _verify(lookup, index, tokens, [5, 5, 5, 5, 5])
    assert index.outcome is Outcome.MISSED
    _verify(lookup, index, tokens, [7, 8, 9, 10, 7])
    assert index.outcome is Outcome.KEPT
    assert lookup.model.chance(Outcome.MISSED, 4, 0) > lookup.model.chance(Outcome.BROKEN, 4, 0)


def test_a_stale_or_missing_proposal_teaches_nothing() -> None:
    lookup = PromptLookup(4, 1, 4)
    index = NgramIndex()
    tokens = LOOP * 4
    assert lookup.propose(index, tokens, limit=9)
    lookup.record(index, len(tokens) + 3, [1, 1, 1, 1, 1], 4, 0)  # not the step it was made for
    lookup.record(index, len(tokens), [1, 1, 1, 1, 1], 4, 0)  # already consumed
    assert lookup.model.chance(Outcome.KEPT, 4, 0) == 0.75 and index.outcome is Outcome.KEPT


def test_poor_drafting_pauses() -> None:
    # Well under MIN_ACCEPTANCE over the probation window: no drafts for a while, then again.
    lookup = PromptLookup(4, 1, 4, min_keep_chance=0.0)  # the learned cut-off out of the way
    index = NgramIndex()
    tokens = LOOP * 4
    for _ in range(4):
        lookup.propose(index, tokens, limit=9)
        lookup.record(index, len(tokens), [1, 1, 1, 1, 1], 4, 0)
    paused = 0
    while not lookup.propose(index, tokens, limit=9) and paused < 100:
        paused += 1
    assert 8 <= paused < 100


# ---- the scheduler -------------------------------------------------------------------------------


def test_a_repeating_prompt_decodes_with_drafts_and_keeps_the_verified_ones() -> None:
    s = make(speculative=3)
    r = req("a", 0, tokens=LOOP * 3, max_tokens=20)
    s.add_request(r)
    out = s.schedule(0.0)
    assert out.chunks[0].draft_token_ids == ()  # a prefill chunk is never drafted
    s.update(out, _sampled(out, {"a": (7,)}), 0.0)
    out, _ = step(s, agree=lambda: True)
    (chunk,) = out.chunks
    # The last token, 7, was followed by 8, 9, 10 in the prompt.
    assert chunk.draft_token_ids == (8, 9, 10) and chunk.num_tokens == chunk.num_sample_rows == 4
    assert chunk.input_token_ids() == [7, 8, 9, 10]
    # Every draft agreed: all of them, plus the token sampled after the last, in one step.
    assert r.output_token_ids == [7, 8, 9, 10, 5]
    assert r.num_computed_tokens == r.num_tokens - 1
    assert s.stats.num_draft_tokens == s.stats.num_accepted_draft_tokens == 3


def test_a_rejected_draft_ends_the_kept_run() -> None:
    s = make(speculative=3)
    r = req("a", 0, tokens=LOOP * 3, max_tokens=20)
    s.add_request(r)
    out = s.schedule(0.0)
    s.update(out, _sampled(out, {"a": (7,)}), 0.0)  # continues the loop: 8, 9, 10 are drafted
    out = s.schedule(1.0)
    (chunk,) = out.chunks
    assert chunk.draft_token_ids == (8, 9, 10)
    # The model agrees with 8, then picks 4 where the draft said 9: 9's row (and 10's) are void.
    s.update(out, _sampled(out, {"a": (8, 4, 11, 12)}), 1.0)
    assert r.output_token_ids == [7, 8, 4]
    assert r.num_computed_tokens == r.num_tokens - 1
    assert (s.stats.num_draft_tokens, s.stats.num_accepted_draft_tokens) == (3, 1)
    s.check_invariants()


def test_drafts_never_pass_max_tokens_and_a_stop_token_ends_the_run() -> None:
    s = make(speculative=4)
    r = req("a", 0, tokens=LOOP * 3, max_tokens=3)
    s.add_request(r)
    out = s.schedule(0.0)
    s.update(out, _sampled(out, {"a": (7,)}), 0.0)
    out = s.schedule(1.0)
    assert out.chunks[0].draft_token_ids == (8,)  # two tokens left to make: one draft at most
    s.update(out, _sampled(out, {"a": (8, 9)}), 1.0)
    assert r.output_token_ids == [7, 8, 9] and r.status is RequestStatus.FINISHED_LENGTH

    s = make(speculative=4)
    r = req("b", 0, tokens=LOOP * 3, max_tokens=20, eos=(9,))
    s.add_request(r)
    out = s.schedule(0.0)
    s.update(out, _sampled(out, {"b": (7,)}), 0.0)
    out = s.schedule(1.0)
    assert out.chunks[0].draft_token_ids == (8, 9, 10, 7)
    s.update(out, _sampled(out, {"b": (8, 9, 10, 7, 8)}), 1.0)
    assert r.output_token_ids == [7, 8, 9] and r.status is RequestStatus.FINISHED_STOPPED
    assert s.num_free_blocks == s.num_total_blocks


def test_no_drafts_without_free_blocks_and_no_preemption_for_them() -> None:
    # 4 blocks of 4: "a" (11-token prompt, then its first token) fills three, "b" the fourth. Both
    # decode within their blocks; a's drafts would need a fifth.
    s = make(speculative=3, block_size=4, num_kv_blocks=4)
    a = req("a", 0, tokens=(LOOP * 3)[:11], max_tokens=20)
    b = req("b", 3, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule(0.0)
    s.update(out, _sampled(out, {"a": (10,), "b": (1,)}), 0.0)
    out = s.schedule(1.0)
    assert [c.draft_token_ids for c in out.chunks] == [(), ()]
    assert s.stats.num_preemptions == 0 and s.num_free_blocks == 0


def test_the_step_budget_bounds_the_drafts() -> None:
    s = make(speculative=4, budget=3)
    r = req("a", 0, tokens=LOOP * 3, max_tokens=20)
    s.add_request(r)
    out = s.schedule(0.0)  # the 12-token prompt in chunks of 3
    while not out.chunks[0].sample:
        s.update(out, _sampled(out, {}), 0.0)
        out = s.schedule(0.0)
    s.update(out, _sampled(out, {"a": (7,)}), 0.0)
    out = s.schedule(1.0)
    assert out.num_batched_tokens == 3 and out.chunks[0].draft_token_ids == (8, 9)


def _sampled(out: SchedulerOutput, tokens: dict[str, tuple[int, ...]]) -> RunnerOutput:
    """The runner's answer to `out`, made by hand: `tokens` per sampling request, one per row."""
    for c in out.chunks:
        if c.sample:
            assert len(tokens[c.request.request_id]) == c.num_sample_rows
    return RunnerOutput(tokens)
