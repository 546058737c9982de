"""What an upstream's streamed chunk may carry, checked before anything of it is relayed or billed.

An upstream is not trusted blindly (issue #36): a `text` that is not a string, a token id that is
not a non-negative integer below 2**31 (the stream log packs ids as unsigned 32-bit; no vocabulary
comes near 2**31), a `finish_reason` that is not a string are a malformed chunk, and the job ends
with `generation_failed`. Output is capped at the request's `max_tokens` (what the gateway
reserved and bills), and the completion tokens billed are the ones sluice counted: exactly when
the upstream sent token ids, else its reported count bounded by what was counted and `max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_TOKEN_ID = 2**31 - 1


class MalformedChunk(ValueError):
    """The chunk breaks the contract above; the message names what (no content of it)."""


@dataclass(frozen=True, slots=True)
class ChoicePiece:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None


def read_choice(choice: Any) -> ChoicePiece:
    """One `choices[i]` of a completions chunk, validated."""
    if not isinstance(choice, dict):
        raise MalformedChunk("a choice is not an object")
    text = choice.get("text")
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise MalformedChunk("a choice's text is not a string")
    raw_ids = choice.get("token_ids")
    if raw_ids is None:
        raw_ids = ()
    if not isinstance(raw_ids, list | tuple):
        raise MalformedChunk("token_ids is not a list")
    for token in raw_ids:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= MAX_TOKEN_ID:
            raise MalformedChunk("a token id is not an integer between 0 and 2**31 - 1")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise MalformedChunk("finish_reason is not a string")
    return ChoicePiece(text, tuple(raw_ids), finish or None)


def billed_completion(counted: int, reported: Any, max_tokens: int, *, exact: bool) -> int:
    """Completion tokens to bill: `counted` when it is exact (token ids were sent); else the
    upstream's report when it is an integer, never below what was counted nor above `max_tokens`."""
    if exact or not isinstance(reported, int) or isinstance(reported, bool):
        return min(counted, max_tokens)
    return min(max(reported, counted), max_tokens)
