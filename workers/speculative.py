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
output, loops. A request drafts one token more than it kept last time (up to the configured
number), and one whose drafts keep failing is not drafted for a while, so a non-repeating stream
costs little.
"""

from __future__ import annotations

from collections.abc import Sequence

# After this many drafted tokens, a request whose drafts were kept less than MIN_ACCEPTANCE of the
# time is drafted again only after PAUSE_STEPS plain decode steps. (A counting pattern such as
# "1 07, 1 08, ..." keeps about a quarter of its drafts and still gains a step in two.)
_PROBATION_TOKENS = 16
_MIN_ACCEPTANCE = 0.15
_PAUSE_STEPS = 16
# Only the last this many tokens of a long prompt are indexed: about 4 dictionary entries per token
# (n-grams of 1..4), so a request's index stays within a few MB whatever its context length.
_MAX_LOOKBACK = 4096


class NgramIndex:
    """Where each n-gram of one request's tokens last occurred with a token after it.

    Built incrementally: each call indexes only the tokens added since the last one, so a
    request costs O(1) dictionary work per token over its life, not a scan of its context per
    step. Owned by its `Request`; only `PromptLookup` reads or writes it.
    """

    __slots__ = ("_ends", "_indexed", "accepted", "drafted", "next_length", "paused")

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._indexed = 0  # n-grams ending before this position are indexed
        self.drafted = 0  # draft tokens proposed since the last reset of the counters
        self.accepted = 0  # of those, kept
        self.paused = 0  # decode steps left without drafts
        self.next_length: int | None = None  # drafts to propose next: one more than last kept

    def extend(self, tokens: Sequence[int], lookup_min: int, lookup_max: int) -> None:
        """Index every n-gram that ends before the last token (so a token follows it)."""
        ends = self._ends
        for end in range(max(self._indexed, lookup_min, len(tokens) - _MAX_LOOKBACK), len(tokens)):
            for n in range(lookup_min, min(lookup_max, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, len(tokens))

    def lookup(self, tokens: Sequence[int], lookup_min: int, lookup_max: int) -> int | None:
        """End of the latest earlier occurrence of the longest suffix of `tokens` that occurred."""
        for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
            end = self._ends.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return end
        return None


class PromptLookup:
    """Proposes draft tokens for a request from its own context (vLLM's "ngram" method)."""

    def __init__(self, num_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.num_tokens = num_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, index: NgramIndex, tokens: Sequence[int], limit: int) -> tuple[int, ...]:
        """At most min(num_tokens, limit) tokens that may follow `tokens` (empty: no guess)."""
        if limit <= 0 or self.num_tokens == 0:
            return ()
        if index.paused:
            index.paused -= 1
            return ()
        index.extend(tokens, self.lookup_min, self.lookup_max)
        end = index.lookup(tokens, self.lookup_min, self.lookup_max)
        if end is None:
            return ()
        length = self.num_tokens if index.next_length is None else index.next_length
        return tuple(tokens[end:end + min(length, limit)])

    def record(self, index: NgramIndex, drafted: int, accepted: int) -> None:
        """Count a verified draft; pause drafting for a request whose drafts are mostly wrong."""
        index.next_length = min(self.num_tokens, accepted + 1)
        index.drafted += drafted
        index.accepted += accepted
        if index.drafted >= _PROBATION_TOKENS:
            if index.accepted < _MIN_ACCEPTANCE * index.drafted:
                index.paused = _PAUSE_STEPS
            index.drafted = index.accepted = 0
