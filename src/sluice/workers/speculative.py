"""Prompt-lookup (n-gram) drafts for speculative decoding. Pure Python, no torch.

A decode normally computes one token per request per step. When a request's last n tokens also
occurred earlier in its prompt or output, the tokens that followed them there are a cheap guess
at what comes next: the step computes the request's last token and up to k such draft tokens
together (one chunk of 1 + k rows), the runner samples at every row, and the scheduler keeps each
draft only while it equals the token sampled before it, plus the token sampled after the last kept
one. The output is exactly what one-token steps give (the sampler is a function of the logits,
the request's seed and the output position alone), while a step that keeps j drafts advances the
request by 1 + j tokens for one pass over the weights and one read of its K/V.

This pays where steps are bound by memory traffic (weights at small batches, the K/V cache at
long contexts) and on text that repeats itself: code edits, quoting RAG answers, structured
output, loops. A draft row is not free, though: on a CPU a batch of more than ~10 rows is
bound by its GEMMs, so a rejected draft costs as much as a real token. Two rules keep the guesses
worth their rows:
- a draft stops at the first position whose estimated chance of being kept is under
  `MIN_KEEP_CHANCE` (`AcceptanceModel`). The estimate is learned online for each kind of guess:
  how long the match was, which position in the draft, and how the request's previous guess
  fared (kept whole, broken after some tokens, or wrong from its first token). On the engine
  bench's random-token requests, a guess made right after a loop broke was kept 13% of the time
  and one continuing an unbroken loop 95%. The token after the last draft is checked for free
  when every draft is kept, so a kind of guess that was cut off can still prove itself;
- a request whose drafts keep failing is not drafted for a while;
- the bar rises with the step's batch (`keep_chance_bar`). With a step costing a + b * rows (a:
  reading the weights and fixed overhead, b: one row's compute), d draft rows that keep K tokens
  on average raise the step's tokens per second iff K / d > b * rows / (a + b * rows): the share of
  the step that grows with its rows. Alone a draft needs a coin flip; at 32 decoding requests 0.84, at
  128 0.95, which chat text almost never reaches and a repetition loop does. On chat traffic at
  a large batch speculation therefore stays out of the way (it cost 6% of throughput there when
  its bar was flat), while a lone stream still gets its drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

# After this many drafted tokens, a request whose drafts were kept less than MIN_ACCEPTANCE of the
# time is drafted again only after PAUSE_STEPS plain decode steps. (A counting pattern such as
# "1 07, 1 08, ..." keeps about a quarter of its drafts and still gains a step in two.)
_PROBATION_TOKENS = 16
_MIN_ACCEPTANCE = 0.15
_PAUSE_STEPS = 16
# Only the last this many tokens of a long prompt are indexed: about 4 dictionary entries per token
# (n-grams of 1..4), so a request's index stays within a few MB whatever its context length.
_MAX_LOOKBACK = 4096
# A draft token is proposed only while its estimated chance of being kept is at least this.
MIN_KEEP_CHANCE = 0.5
# a / b of the step-cost model above, in rows: the batch at which the rows' compute equals the
# fixed cost of a step. SmolLM2-135M in float32 on 2 EPYC cores: a ~23 ms (the single-stream ITL),
# b ~3-5 ms (0.27 GFLOP a row at the ~55-90 GFLOP/s the engine reaches in full batches).
STEP_KNEE_ROWS = 6
# The estimate starts at 3 kept of 4 (so an unseen kind of guess is tried) and forgets with this
# weight per observation: it follows the last ~64 guesses of its kind.
_PRIOR_KEPT, _PRIOR_SEEN = 3.0, 4.0
_DECAY = 63 / 64


class Outcome(IntEnum):
    """How a request's previous guess fared, which predicts its next one."""

    KEPT = 0  # every token checked was right (or there was no guess yet)
    BROKEN = 1  # right for some tokens, then wrong: a loop that just ended
    MISSED = 2  # wrong from its first token


@dataclass(frozen=True, slots=True)
class Proposal:
    """A guess made for one step: `tokens` from a match of `match` tokens. The scheduler sends a
    prefix of them as drafts (`PromptLookup.record` is told how many); the one after that prefix
    is kept back to learn from (it is checked for free when every draft is kept)."""

    position: int  # the request's token count when it was made
    match: int
    outcome: Outcome
    tokens: tuple[int, ...]


class NgramIndex:
    """Where each n-gram of one request's tokens last occurred with a token after it, and how the
    request's guesses have fared.

    Built incrementally: each call indexes only the tokens added since the last one, so a
    request costs O(1) dictionary work per token over its life, not a scan of its context per
    step. Owned by its `Request`; only `PromptLookup` reads or writes it.
    """

    __slots__ = ("_ends", "_indexed", "accepted", "drafted", "outcome", "paused", "pending")

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._indexed = 0  # n-grams ending before this position are indexed
        self.drafted = 0  # draft tokens proposed since the last reset of the counters
        self.accepted = 0  # of those, kept
        self.paused = 0  # decode steps left without drafts
        self.outcome = Outcome.KEPT  # how the last checked guess fared
        self.pending: Proposal | None = None  # the guess of the step in flight

    def extend(self, tokens: Sequence[int], lookup_min: int, lookup_max: int) -> None:
        """Index every n-gram that ends before the last token (so a token follows it)."""
        ends = self._ends
        for end in range(max(self._indexed, lookup_min, len(tokens) - _MAX_LOOKBACK), len(tokens)):
            for n in range(lookup_min, min(lookup_max, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, len(tokens))

    def lookup(self, tokens: Sequence[int], lookup_min: int, lookup_max: int) -> tuple[int, int] | None:
        """(end, n) of the latest earlier occurrence of the longest suffix of `tokens`, n tokens
        long, that occurred; None if none did."""
        for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
            end = self._ends.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return end, n
        return None


class AcceptanceModel:
    """The chance that a draft token is kept, given that the ones before it in its draft were:
    decayed counts per (outcome of the request's previous guess, match length, position)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[Outcome, int, int], tuple[float, float]] = {}

    def chance(self, outcome: Outcome, match: int, position: int) -> float:
        kept, seen = self._counts.get((outcome, match, position), (_PRIOR_KEPT, _PRIOR_SEEN))
        return kept / seen

    def observe(self, outcome: Outcome, match: int, position: int, hit: bool) -> None:
        kept, seen = self._counts.get((outcome, match, position), (_PRIOR_KEPT, _PRIOR_SEEN))
        self._counts[outcome, match, position] = (kept * _DECAY + hit, seen * _DECAY + 1)


class PromptLookup:
    """Proposes draft tokens for a request from its own context (vLLM's "ngram" method), gated by
    an `AcceptanceModel` it learns from every checked guess."""

    def __init__(self, num_tokens: int, lookup_min: int, lookup_max: int,
                 min_keep_chance: float = MIN_KEEP_CHANCE, knee_rows: float = STEP_KNEE_ROWS) -> None:
        self.num_tokens = num_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self.min_keep_chance = min_keep_chance
        self.knee_rows = knee_rows
        self.model = AcceptanceModel()

    def keep_chance_bar(self, batch_rows: int) -> float:
        """The chance of being kept a draft token needs in a step of `batch_rows` other rows."""
        if self.knee_rows <= 0:
            return self.min_keep_chance
        return max(self.min_keep_chance, batch_rows / (batch_rows + self.knee_rows))

    def propose(self, index: NgramIndex, tokens: Sequence[int], limit: int,
                batch_rows: int = 1) -> tuple[int, ...]:
        """At most min(num_tokens, limit) tokens that may follow `tokens` (empty: no guess), in a
        step that computes about `batch_rows` rows besides."""
        index.pending = None
        if limit <= 0 or self.num_tokens == 0:
            return ()
        if index.paused:
            index.paused -= 1
            return ()
        index.extend(tokens, self.lookup_min, self.lookup_max)
        found = index.lookup(tokens, self.lookup_min, self.lookup_max)
        if found is None:
            return ()
        end, match = found
        guess = tuple(tokens[end:end + min(self.num_tokens, limit)])
        bar = self.keep_chance_bar(batch_rows)
        drafted = 0
        while drafted < len(guess) and self.model.chance(index.outcome, match, drafted) >= bar:
            drafted += 1
        index.pending = Proposal(len(tokens), match, index.outcome, guess)
        return guess[:drafted]

    def record(self, index: NgramIndex, position: int, sampled: Sequence[int], drafted: int, kept: int) -> None:
        """Learn from the step's guess for a request that had `position` tokens: `sampled` are the
        tokens the model chose at its rows (the last token's, then each draft's); `drafted` drafts
        were sent (fewer than proposed when no block was free for them), the first `kept` kept.
        Pauses drafting for a request whose drafts are mostly wrong."""
        proposal, index.pending = index.pending, None
        if proposal is None or proposal.position != position:
            return
        # The model's token at guess position p is sampled[p] while every draft before p was kept.
        checked = min(kept + 1, len(proposal.tokens), len(sampled))
        hits = 0
        while hits < checked and proposal.tokens[hits] == sampled[hits]:
            hits += 1
        for p in range(min(hits + 1, checked)):
            self.model.observe(proposal.outcome, proposal.match, p, p < hits)
        if checked:
            index.outcome = (Outcome.KEPT if hits == checked else Outcome.BROKEN if hits else Outcome.MISSED)
        if not drafted:
            return
        index.drafted += drafted
        index.accepted += kept
        if index.drafted >= _PROBATION_TOKENS:
            if index.accepted < _MIN_ACCEPTANCE * index.drafted:
                index.paused = _PAUSE_STEPS
            index.drafted = index.accepted = 0
