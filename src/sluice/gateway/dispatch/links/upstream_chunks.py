"""What an upstream's streamed chunk may carry, checked before anything of it is relayed or billed.

An upstream is not trusted blindly (issue #36): a `text` that is not a string, a token id that is
not a non-negative integer below 2**31 (the stream log packs ids as unsigned 32-bit; no vocabulary
comes near 2**31), a `finish_reason` that is not a string are a malformed chunk, and the job ends
with `generation_failed`. Output is capped at the request's `max_tokens` (what the gateway
reserved and bills), and the completion tokens billed are the ones sluice counted: exactly when
the upstream sent token ids, else its reported count bounded by what was counted and `max_tokens`.

Logprobs (a kind "vllm" upstream, asked with `logprobs: N` and `return_tokens_as_token_ids`, so
each token is named "token_id:ID" and never by a text that may not survive JSON): a choice that
carries tokens must carry one entry per token id, each naming that same id, each value a finite
number <= 0 (a log probability; vLLM writes -9999.0 for -inf), and at most N + 1 alternatives
(vLLM adds the chosen token to the top N), else the chunk is malformed. The top N by value are kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sluice.protocol import PositionLogprobs, TokenLogprob

MAX_TOKEN_ID = 2**31 - 1
TOKEN_ID_PREFIX = "token_id:"  # vLLM's name of a token under `return_tokens_as_token_ids`


class MalformedChunk(ValueError):
    """The chunk breaks the contract above; the message names what (no content of it)."""


@dataclass(frozen=True, slots=True)
class ChoicePiece:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: tuple[PositionLogprobs, ...] = ()


def _is_token_id(token: Any) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token <= MAX_TOKEN_ID


def read_choice(choice: Any, top_logprobs: int | None = None) -> ChoicePiece:
    """One `choices[i]` of a completions chunk, validated; `top_logprobs`: the request asked for
    logprobs with that many alternatives (None: it did not, and any the chunk has are ignored)."""
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
    if not all(_is_token_id(token) for token in raw_ids):
        raise MalformedChunk("a token id is not an integer between 0 and 2**31 - 1")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise MalformedChunk("finish_reason is not a string")
    positions: tuple[PositionLogprobs, ...] = ()
    if top_logprobs is not None and (text or raw_ids):
        positions = read_logprobs(choice.get("logprobs"), tuple(raw_ids), top_logprobs)
    return ChoicePiece(text, tuple(raw_ids), finish or None, positions)


def read_logprobs(raw: Any, token_ids: tuple[int, ...], top_n: int) -> tuple[PositionLogprobs, ...]:
    """A choice's completions-shaped `logprobs` for `token_ids`, validated (module docstring)."""
    if not isinstance(raw, dict):
        raise MalformedChunk("the upstream sent no logprobs for its tokens")
    tokens, values, tops = raw.get("tokens"), raw.get("token_logprobs"), raw.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        raise MalformedChunk("logprobs.tokens or logprobs.token_logprobs is not a list")
    if not token_ids or not len(tokens) == len(values) == len(token_ids):
        raise MalformedChunk("logprobs do not match the chunk's token ids one for one")
    if tops is None:
        tops = [{}] * len(tokens)
    if not isinstance(tops, list) or len(tops) != len(tokens):
        raise MalformedChunk("logprobs.top_logprobs does not match the chunk's tokens")
    positions = []
    for token, value, top, token_id in zip(tokens, values, tops, token_ids, strict=True):
        if _named_id(token) != token_id:
            raise MalformedChunk("a logprobs token does not name the chunk's token id")
        if top is None:
            top = {}
        if not isinstance(top, dict) or len(top) > top_n + 1:
            raise MalformedChunk("a position's top_logprobs is not an object of at most top_logprobs + 1")
        alternatives = sorted((TokenLogprob(_named_id(name), _logprob(lp)) for name, lp in top.items()),
                              key=lambda alt: -alt.logprob)
        positions.append(PositionLogprobs(TokenLogprob(token_id, _logprob(value)), tuple(alternatives[:top_n])))
    return tuple(positions)


def _named_id(token: Any) -> int:
    """The id in vLLM's "token_id:ID" name of a token."""
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
        digits = token[len(TOKEN_ID_PREFIX):]
        if digits.isascii() and digits.isdigit() and len(digits) <= 10 and _is_token_id(int(digits)):
            return int(digits)
    raise MalformedChunk("a logprobs token is not named by its id (token_id:ID)")


def _logprob(value: Any) -> float:
    if not isinstance(value, bool) and isinstance(value, int | float):
        try:
            number = float(value)  # OverflowError: an integer beyond any float
        except OverflowError:
            number = math.nan
        if math.isfinite(number) and number <= 0:
            return number
    raise MalformedChunk("a logprob is not a finite number <= 0")


def billed_completion(counted: int, reported: Any, max_tokens: int, *, exact: bool) -> int:
    """Completion tokens to bill: `counted` when it is exact (token ids were sent); else the
    upstream's report when it is an integer, never below what was counted nor above `max_tokens`."""
    if exact or not isinstance(reported, int) or isinstance(reported, bool):
        return min(counted, max_tokens)
    return min(max(reported, counted), max_tokens)
