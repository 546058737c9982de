"""Incremental detokenization with stop strings, one instance per request.

Text is decoded over a sliding window of token ids (a few tokens of context before the
unread ones, so tokenizers that drop a leading space at the start of a decode still produce
the right spacing). Two hold-backs keep what we emit final:
  * text ending in U+FFFD is an incomplete UTF-8 character: wait for the next token;
  * the longest suffix that is a prefix of a stop string: it may become a match.
On a stop-string match the text is truncated before the match and `stopped` is set; the
engine then finishes the request with reason "stop".

A resumed request (its earlier output produced elsewhere, `resume_token_ids`) is primed by
replaying those tokens one at a time, as the engine fed them to the first run (one token per
step), so the state after priming (text emitted, text held back, window offsets) is the one the
undisturbed run had: what it emits next is exactly what that run would have emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Decode = Callable[[Sequence[int]], str]  # token ids -> text (special tokens skipped)

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True, slots=True)
class DetokenizerOutput:
    text: str  # new text safe to emit
    stopped: bool  # a stop string matched; nothing after it will ever be emitted
    num_tokens: int  # of the tokens given, those read: all, or up to the one that completed the stop


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 resume_token_ids: Sequence[int] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._decode = decode
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context  # context tokens + output tokens
        self._prefix_offset = 0  # window start: context for the decode
        self._read_offset = len(context)  # tokens before this are already in self._text
        self._text = ""  # all decoded output text (confirmed complete characters)
        self._emitted = 0  # characters of self._text already returned
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.stopped = False
        for token_id in resume_token_ids:  # priming: the text of these was delivered already
            if self.add_tokens((token_id,)).stopped:
                raise ValueError("the resumed output tokens already end with a stop string")

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text[: self._emitted]

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerOutput:
        if self.stopped:
            return DetokenizerOutput("", True, 0)
        old_len = len(self._text)
        for i, token_id in enumerate(token_ids):
            self._ids.append(token_id)
            self._text += self._decode_new(final=False)
            if self._stop and self._check_stop(old_len):
                return DetokenizerOutput(self._emit(len(self._text)), True, i + 1)
        return DetokenizerOutput(self._emit(len(self._text) - self._held_stop_prefix()), False, len(token_ids))

    def flush(self) -> str:
        """At the end of a request (not by stop string): the text held back so far."""
        if self.stopped:
            return ""
        self._text += self._decode_new(final=True)
        if self._stop and self._check_stop(max(0, self._emitted - self._max_stop)):
            return self._emit(len(self._text))
        return self._emit(len(self._text))

    def _decode_new(self, *, final: bool) -> str:
        window = self._ids[self._prefix_offset:]
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not final):
            return ""  # nothing new yet, or an unfinished multi-byte character
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _check_stop(self, old_len: int) -> bool:
        # A match can only end in the new text; it may start up to max_stop - 1 chars before it.
        start = max(0, old_len - self._max_stop + 1)
        best = -1
        for s in self._stop:
            i = self._text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best = i
        if best == -1:
            return False
        self._text = self._text[: max(best, self._emitted)]
        self.stopped = True
        return True

    def _held_stop_prefix(self) -> int:
        """Length of the longest suffix of the unemitted text that starts some stop string."""
        hold = 0
        tail = self._text[self._emitted:]
        for s in self._stop:
            for k in range(min(len(s) - 1, len(tail)), hold, -1):
                if tail.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self._text[self._emitted:upto]
        self._emitted = upto
        return out
