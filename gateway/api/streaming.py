"""Turning a Flight's deltas into OpenAI answers: SSE chunk streams and whole responses.

SSE frames are written as pre-encoded bytes (`data: <json>\\n\\n`) through Litestar's `Stream`
rather than its `ServerSentEvent`: the latter starts every stream with a thread-pool hop and
builds each event through StringIO, which costs too much at 200 concurrent streams on 2 cores.
msgspec JSON never contains a raw newline, so one `data:` line per event is always valid.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from sluice.gateway.api.generation import Flight
from sluice.gateway.errors import OpenAIError
from sluice.gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    TokenLogprobOut,
    TopLogprob,
    Usage,
)
from sluice.gateway.tokenization import ModelTokenizer
from sluice.protocol import FinishReason, PositionLogprobs

_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"


def sse(payload: msgspec.Struct | dict[str, object]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def _finish(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)


def _error_body(flight: Flight) -> dict[str, object]:
    return {
        "error": {
            "message": f"Generation failed: {flight.error or 'backend error'}",
            "type": "server_error",
            "param": None,
            "code": "generation_failed",
        }
    }


def _usage(flight: Flight) -> Usage:
    prompt = flight.prompt_tokens or len(flight.prepared.request.prompt_token_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=flight.completion_tokens,
        total_tokens=prompt + flight.completion_tokens,
    )


def chat_logprobs(
    tokenizer: ModelTokenizer, positions: tuple[PositionLogprobs, ...], top_n: int
) -> list[TokenLogprobOut]:
    out = []
    for position in positions:
        text = tokenizer.token_text(position.chosen.token_id)
        top = [
            TopLogprob(
                token=(t := tokenizer.token_text(c.token_id)),
                logprob=c.logprob,
                bytes=list(t.encode("utf-8")),
            )
            for c in position.top[:top_n]
        ]
        out.append(
            TokenLogprobOut(
                token=text,
                logprob=position.chosen.logprob,
                bytes=list(text.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return out


def completion_logprobs(
    tokenizer: ModelTokenizer, positions: tuple[PositionLogprobs, ...], top_n: int, offset: int
) -> CompletionLogprobs:
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for position in positions:
        text = tokenizer.token_text(position.chosen.token_id)
        tokens.append(text)
        values.append(position.chosen.logprob)
        tops.append({tokenizer.token_text(c.token_id): c.logprob for c in position.top[:top_n]})
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops if top_n else None, text_offset=offsets
    )


# ---- streaming ---------------------------------------------------------------------------------


async def stream_chat(flight: Flight) -> AsyncIterator[bytes]:
    prepared = flight.prepared
    request = prepared.request
    usage_field: Usage | msgspec.UnsetType | None = None if prepared.include_usage else msgspec.UNSET
    want_logprobs = request.sampling.logprobs
    top_n = request.sampling.top_logprobs

    def chunk(delta: ChunkDelta, finish: str | None = None, logprobs: ChoiceLogprobs | None = None) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=request.request_id,
                created=flight.created,
                model=request.model,
                service_tier=prepared.tier,
                choices=[ChatChunkChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=finish)],
                usage=usage_field,
            )
        )

    aborted = True
    try:
        yield chunk(ChunkDelta(role="assistant", content=""))
        async for delta in flight.submission:
            flight.observe(delta)
            if delta.finish_reason is FinishReason.ERROR:
                aborted = False
                yield sse(_error_body(flight))  # an error event, then the stream ends (no [DONE])
                return
            logprobs = None
            if want_logprobs and delta.logprobs:
                logprobs = ChoiceLogprobs(content=chat_logprobs(prepared.tokenizer, delta.logprobs, top_n))
            if delta.text or logprobs is not None:
                yield chunk(ChunkDelta(content=delta.text), None, logprobs)
            if delta.finish_reason is not None:
                yield chunk(ChunkDelta(), _finish(delta.finish_reason))
                if prepared.include_usage:
                    yield sse(
                        ChatCompletionChunk(
                            id=request.request_id,
                            created=flight.created,
                            model=request.model,
                            service_tier=prepared.tier,
                            choices=[],
                            usage=_usage(flight),
                        )
                    )
        aborted = False
        yield DONE
    finally:
        # Runs on normal end, on client disconnect (cancellation) and on generator close.
        flight.finish(aborted=aborted and flight.finish_reason is None)


async def stream_completion(flight: Flight) -> AsyncIterator[bytes]:
    prepared = flight.prepared
    request = prepared.request
    usage_field: Usage | msgspec.UnsetType | None = None if prepared.include_usage else msgspec.UNSET
    want_logprobs = request.sampling.logprobs
    top_n = request.sampling.top_logprobs
    offset = 0

    def chunk(text: str, finish: str | None, logprobs: CompletionLogprobs | None = None) -> bytes:
        return sse(
            CompletionChunk(
                id=request.request_id,
                created=flight.created,
                model=request.model,
                service_tier=prepared.tier,
                choices=[CompletionChoice(index=0, text=text, logprobs=logprobs, finish_reason=finish)],
                usage=usage_field,
            )
        )

    aborted = True
    try:
        async for delta in flight.submission:
            flight.observe(delta)
            if delta.finish_reason is FinishReason.ERROR:
                aborted = False
                yield sse(_error_body(flight))  # an error event, then the stream ends (no [DONE])
                return
            logprobs = None
            if want_logprobs and delta.logprobs:
                logprobs = completion_logprobs(prepared.tokenizer, delta.logprobs, top_n, offset)
            if delta.text or logprobs is not None or delta.finish_reason is not None:
                yield chunk(delta.text, _finish(delta.finish_reason), logprobs)
                offset += len(delta.text)
            if delta.finish_reason is not None and prepared.include_usage:
                yield sse(
                    CompletionChunk(
                        id=request.request_id,
                        created=flight.created,
                        model=request.model,
                        service_tier=prepared.tier,
                        choices=[],
                        usage=_usage(flight),
                    )
                )
        aborted = False
        yield DONE
    finally:
        flight.finish(aborted=aborted and flight.finish_reason is None)


# ---- whole responses ---------------------------------------------------------------------------


async def _collect(flight: Flight) -> tuple[str, list[tuple[PositionLogprobs, ...]]]:
    texts: list[str] = []
    logprobs: list[tuple[PositionLogprobs, ...]] = []
    aborted = True
    try:
        async for delta in flight.submission:
            flight.observe(delta)
            texts.append(delta.text)
            if delta.logprobs:
                logprobs.append(delta.logprobs)
        aborted = False
    except asyncio.CancelledError:
        raise
    finally:
        flight.finish(aborted=aborted and flight.finish_reason is None)
    if flight.finish_reason == FinishReason.ERROR:
        raise OpenAIError(
            500,
            f"Generation failed: {flight.error or 'backend error'}",
            type="server_error",
            code="generation_failed",
        )
    return "".join(texts), logprobs


async def complete_chat(flight: Flight) -> ChatCompletion:
    text, positions = await _collect(flight)
    prepared = flight.prepared
    request = prepared.request
    logprobs = None
    if request.sampling.logprobs:
        flat = tuple(p for group in positions for p in group)
        logprobs = ChoiceLogprobs(
            content=chat_logprobs(prepared.tokenizer, flat, request.sampling.top_logprobs)
        )
    return ChatCompletion(
        id=request.request_id,
        created=flight.created,
        model=request.model,
        service_tier=prepared.tier,
        choices=[
            ChatChoice(
                index=0,
                message=AssistantMessage(content=text),
                logprobs=logprobs,
                finish_reason=flight.finish_reason,
            )
        ],
        usage=_usage(flight),
    )


async def complete_text(flight: Flight) -> Completion:
    text, positions = await _collect(flight)
    prepared = flight.prepared
    request = prepared.request
    logprobs = None
    if request.sampling.logprobs:
        flat = tuple(p for group in positions for p in group)
        logprobs = completion_logprobs(prepared.tokenizer, flat, request.sampling.top_logprobs, 0)
    return Completion(
        id=request.request_id,
        created=flight.created,
        model=request.model,
        service_tier=prepared.tier,
        choices=[CompletionChoice(index=0, text=text, logprobs=logprobs, finish_reason=flight.finish_reason)],
        usage=_usage(flight),
    )
