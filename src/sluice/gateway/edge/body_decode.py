"""Strict decoding of JSON request bodies, and the verdict on a dense one away from the gateway.

msgspec decodes in C holding the GIL: 200,000 small JSON values take ~100 ms on whatever thread
runs them, so a worker thread would stall the event loop just the same. A body whose bytes could
hold more than `DENSE_VALUES` values (an upper bound counted from its commas and brackets, which is
cheap) is therefore judged first in a helper process: decoded strictly there and checked against
the cheap size limits (message count, prompt characters). A body to refuse is refused without ever
being decoded in the gateway; only a body that passed is decoded here, once.

This module imports no web framework, so the helper process loads little more than msgspec and the
body types. The 400s it describes are `BodyFault`s; `edge/errors.py` turns them into errors
(`edge/json_body.py` is the hook that asks).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from sluice.gateway.edge.schemas import ChatCompletionRequest, CompletionRequest

DENSE_VALUES = 50_000  # about 25 ms of decoding: denser bodies are judged in the helper process
NESTED_TOO_DEEPLY = "The JSON is nested too deeply."
_PATH = re.compile(r" - at `\$\.?([^`]*)`")
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


class BodyFault(msgspec.Struct, frozen=True):
    """A 400 for a request body: what is wrong, the field (`param`) and an error `code`."""

    message: str
    param: str | None = None
    code: str | None = None


class InvalidBody(ValueError):
    def __init__(self, fault: BodyFault) -> None:
        super().__init__(fault.message)
        self.fault = fault


@dataclass(frozen=True, slots=True)
class SizeLimits:
    """The cheap limits checked before any tokenization (`gateway.max_messages` / `max_prompt_chars`)."""

    max_messages: int
    max_prompt_chars: int
    max_n: int = 8  # `gateway.max_n`: choices of one answer


def validation_fault(error: msgspec.ValidationError) -> BodyFault:
    """msgspec's "Expected `int` >= 1 - at `$.max_tokens`" as a fault with param `max_tokens`."""
    text = str(error)
    match = _PATH.search(text)
    if match is None or not match.group(1):
        return BodyFault(f"Invalid request body: {text}.")
    param = match.group(1)
    return BodyFault(f"Invalid `{param}` in the request body: {text[: match.start()]}.", param)


def decode(raw: bytes, body_type: Any) -> Any:
    """`raw` strictly decoded into `body_type`; raises `InvalidBody` with the 400 to answer."""
    decoder = _decoders.get(body_type)
    if decoder is None:
        decoder = _decoders[body_type] = msgspec.json.Decoder(body_type)
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise InvalidBody(validation_fault(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidBody(BodyFault(f"The request body is not valid JSON: {exc}.")) from None
    except RecursionError:
        raise InvalidBody(BodyFault(NESTED_TOO_DEEPLY, code="json_too_deep")) from None


def prompt_chars(body: ChatCompletionRequest | CompletionRequest) -> int:
    """Characters of text to tokenize (a token-id prompt has none), counted without tokenizing."""
    if isinstance(body, CompletionRequest):
        return len(body.prompt) if isinstance(body.prompt, str) else 0
    total = 0
    for message in body.messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.text or "") for part in content)
    return total


def size_fault(body: object, limits: SizeLimits) -> BodyFault | None:
    """The cheap-limit 400 for a generation body (too many messages, too many characters), if any."""
    if not isinstance(body, ChatCompletionRequest | CompletionRequest):
        return None
    if body.n is not None and body.n > limits.max_n:
        return BodyFault(f"n is {body.n}; at most {limits.max_n} choices per request are allowed.", "n",
                         "integer_above_max_value")
    param = "prompt"
    if isinstance(body, ChatCompletionRequest):
        param = "messages"
        if len(body.messages) > limits.max_messages:
            return BodyFault(f"messages has {len(body.messages)} items; at most {limits.max_messages} are allowed.",
                             param, "array_above_max_length")
    chars = prompt_chars(body)
    if chars > limits.max_prompt_chars:
        return BodyFault(f"The prompt has {chars} characters; at most {limits.max_prompt_chars} are allowed.",
                         param, "string_above_max_length")
    return None


def is_dense(raw: bytes) -> bool:
    """Whether `raw` may hold more than `DENSE_VALUES` JSON values (commas in strings count too)."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") > DENSE_VALUES


def judge(raw: bytes, body_type: Any, limits: SizeLimits) -> BodyFault | None:
    """In the helper process: the 400 that `raw` deserves (bad JSON, bad field, over a limit), or None."""
    try:
        return size_fault(decode(raw, body_type), limits)
    except InvalidBody as exc:
        return exc.fault


class BodyJudge:
    """One helper process, started at the first dense body, that runs `judge` (one body at a time,
    so a flood of dense bodies queues there instead of taking every core)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def judge(self, raw: bytes, body_type: Any, limits: SizeLimits) -> BodyFault | None:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return await asyncio.get_running_loop().run_in_executor(self._pool, judge, raw, body_type, limits)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
