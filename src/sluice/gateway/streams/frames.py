"""Turning a Flight's deltas into OpenAI answers: SSE chunk streams and whole responses.

SSE frames are written as pre-encoded bytes (`data: <json>\\n\\n`) through Litestar's `Stream`
rather than its `ServerSentEvent`: the latter starts every stream with a thread-pool hop and
builds each event through StringIO, which costs too much at 200 concurrent streams on 2 cores.
msgspec JSON never contains a raw newline, so one `data:` line per event is always valid.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import msgspec
from msgspec.structs import replace

from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.edge.schemas import (
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
    PromptTokensDetails,
    TokenLogprobOut,
    TopLogprob,
    Usage,
)
from sluice.gateway.generation.service import Flight, RequestTimedOut
from sluice.gateway.generation.tokenization import ModelTokenizer
from sluice.protocol import FinishReason, PositionLogprobs, RequestDelta

_ChunkT = TypeVar("_ChunkT", ChatCompletionChunk, CompletionChunk)
_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"

log = logging.getLogger(__name__)


def sse(payload: msgspec.Struct | dict[str, object]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def _finish(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)


def _failure_message(flight: Flight) -> str:
    """What the client is told when generation fails; the worker's own reason (exception text,
    worker ids) goes to the log under the request id, never to the client."""
    log.warning("request %s failed: %s", flight.request_id, flight.error or "backend error")
    return f"Generation failed on the server (request {flight.request_id}); please retry."


def _error_body(flight: Flight) -> dict[str, object]:
    return {
        "error": {
            "message": _failure_message(flight),
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
        # At most the prompt: a resumed request's engine counts the resumed output it found cached too.
        prompt_tokens_details=PromptTokensDetails(cached_tokens=min(flight.cached_tokens, prompt)),
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


def _envelope(flight: Flight) -> dict[str, Any]:
    """The fields every answer and chunk of one request repeats (the choices and usage vary)."""
    request = flight.prepared.request
    return {
        "id": request.request_id,
        "created": flight.created,
        "model": request.model,
        "service_tier": flight.prepared.tier,
    }


def _template(flight: Flight, chunk_type: type[_ChunkT]) -> _ChunkT:
    """A stream's chunk without choices; every chunk is a copy of it with its own choices
    (`replace` is several times cheaper than building each chunk from keyword arguments).

    Its usage is null when include_usage is set (only the last chunk carries it), else absent.
    """
    usage = None if flight.prepared.include_usage else msgspec.UNSET
    return chunk_type(**_envelope(flight), choices=[], usage=usage)


def _step(flight: Flight, template: ChatCompletionChunk | CompletionChunk,
          frames: Callable[[RequestDelta], Iterator[bytes]], delta: RequestDelta,
          emit: Callable[[bytes], None]) -> bool | None:
    """One delta's SSE events, passed to `emit`. Returns None while the stream goes on, False at
    its end, True when it ended with an error (an error event that ends the stream: no [DONE]).

    With include_usage, the template chunk (no choices) carrying the usage follows the finishing
    delta's chunks.
    """
    flight.observe(delta)
    if delta.finish_reason is FinishReason.ERROR:
        emit(sse(_error_body(flight)))
        return True
    for frame in frames(delta):
        emit(frame)
    if delta.finish_reason is None:
        return None
    if flight.prepared.include_usage:
        emit(sse(replace(template, usage=_usage(flight))))
    return False


async def _stream(
    flight: Flight,
    template: ChatCompletionChunk | CompletionChunk,
    frames: Callable[[RequestDelta], Iterator[bytes]],
    opening: bytes | None = None,
) -> AsyncGenerator[bytes, None]:
    """The SSE loop of both endpoints, pulling the deltas: `frames` turns one delta into its chunks."""
    aborted = True
    try:
        if opening is not None:
            yield opening
        out: list[bytes] = []
        try:
            async for delta in flight.deltas():
                ended = _step(flight, template, frames, delta, out.append)
                for frame in out:
                    yield frame
                out.clear()
                if ended:
                    aborted = False
                    return
        except RequestTimedOut as exc:  # after the first byte: an error event ends the stream
            yield sse(exc.body())
            return  # `aborted` stays set: the request is stopped at its worker
        aborted = False
        flight.finish()
        await flight.settled()  # before [DONE]: the client's next request finds this one ended
        yield DONE
    finally:
        # Runs on normal end, on client disconnect (cancellation) and on generator close.
        flight.finish(aborted=aborted and flight.finish_reason is None)


class SSEStream:
    """One streamed answer's SSE events: iterated (the deltas pulled through `Flight.deltas`), or
    `begin` then `run` by the stream pump with an `emit` callback.

    The pump pushes when the submission takes a listener (`QueuedSubmission.listen`): each delta
    is framed and emitted within its delivery (the upstream reader's or the dispatcher's call),
    with no task step, queue hop or chain of async generators per token (at 200 streams on one
    core those were ~10 % of the gateway's CPU); the pump's task only waits for the end (it
    settles the quota before [DONE]), the deadline, or its own cancellation (grace over,
    shutdown). The events are the same either way.
    """

    __slots__ = ("_ended", "flight", "frames", "opening", "template")

    def __init__(self, flight: Flight, template: ChatCompletionChunk | CompletionChunk,
                 frames: Callable[[RequestDelta], Iterator[bytes]], opening: bytes | None = None) -> None:
        self.flight = flight
        self.template = template
        self.frames = frames
        self.opening = opening
        # Pushing: whether the stream ended with an error event. Done (or cancelled) = no delta
        # after it is framed: a late one after an abort, a timeout or the pump's end is dropped.
        self._ended: asyncio.Future[bool] | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _stream(self.flight, self.template, self.frames, self.opening)

    def begin(self, emit: Callable[[bytes], None]) -> None:
        """In the caller's call: emits what exists already (the opening, the delta `first_delta`
        read ahead) and listens for the rest, so the POST's first events are in the log before its
        response starts. Does nothing when the submission takes no listener (`run` pulls)."""
        listen: Callable[[Callable[[RequestDelta], None]], None] | None = getattr(
            self.flight.submission, "listen", None)
        if listen is None or self._ended is not None:
            return
        flight, template, frames = self.flight, self.template, self.frames
        ended: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._ended = ended

        def on_delta(delta: RequestDelta) -> None:
            if ended.done():
                return
            try:
                end = _step(flight, template, frames, delta, emit)
            except Exception as exc:  # never into the deliverer (the upstream reader, the dispatcher)
                ended.set_exception(exc)
                return
            if end is not None:
                ended.set_result(end)

        if self.opening is not None:
            emit(self.opening)
        first = flight.take_first()
        if first is not None:
            on_delta(first)
        if not ended.done():
            listen(on_delta)

    async def run(self, emit: Callable[[bytes], None]) -> None:
        """Every event (after those `begin` emitted) to `emit`, in order, until the stream ends; on
        cancellation the request is aborted at its worker (as a disconnect always did)."""
        ended = self._ended
        if ended is None:
            pulled = _stream(self.flight, self.template, self.frames, self.opening)
            try:
                async for frame in pulled:
                    emit(frame)
            finally:
                await pulled.aclose()
            return
        flight = self.flight
        aborted = True
        try:
            try:
                errored = await flight.within_deadline(ended)
            except RequestTimedOut as exc:  # after the first byte: an error event ends the stream
                emit(sse(exc.body()))
                return  # `aborted` stays set: the request is stopped at its worker
            aborted = False
            if errored:
                return
            flight.finish()
            await flight.settled()  # before [DONE]: the client's next request finds this one ended
            emit(DONE)
        finally:
            if not ended.done():
                ended.cancel()
            flight.finish(aborted=aborted and flight.finish_reason is None)


class _TextEvent:
    """The event of a delta that is text alone, the most frequent by far: this stream's one chunk
    encoded once with empty text, and the text's JSON string put in its place per delta. The same
    bytes as encoding the whole chunk each time (msgspec writes a string the same way alone as
    inside a struct), for one short string instead of the envelope's structs and fields."""

    __slots__ = ("_head", "_tail")

    def __init__(self, empty: bytes, field: bytes) -> None:
        # The text field is the choice's, after the envelope's strings (id, model) in the chunk.
        at = empty.rindex(field) + len(field) - 2  # just before its empty string ""
        self._head, self._tail = empty[:at], empty[at + 2 :]

    def with_text(self, text: str) -> bytes:
        return self._head + _encode(text) + self._tail


def stream_chat(flight: Flight, *, resumed: bool = False) -> SSEStream:
    """`resumed`: continuing a stream another replica started (gateway/streams/holder.py): no role chunk."""
    prepared = flight.prepared
    sampling = prepared.request.sampling
    template = _template(flight, ChatCompletionChunk)

    def chunk(delta: ChunkDelta, finish: str | None = None, logprobs: ChoiceLogprobs | None = None) -> bytes:
        choice = ChatChunkChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=finish)
        return sse(replace(template, choices=[choice]))

    text_event = _TextEvent(chunk(ChunkDelta(content="")), b'"content":""')

    def frames(delta: RequestDelta) -> Iterator[bytes]:
        logprobs = None
        if sampling.logprobs and delta.logprobs:
            logprobs = ChoiceLogprobs(content=chat_logprobs(prepared.tokenizer, delta.logprobs, sampling.top_logprobs))
        if logprobs is not None:
            yield chunk(ChunkDelta(content=delta.text), None, logprobs)
        elif delta.text:
            yield text_event.with_text(delta.text)
        if delta.finish_reason is not None:
            yield chunk(ChunkDelta(), _finish(delta.finish_reason))

    # OpenAI's first chunk names the role (a resumed stream sent it already).
    opening = None if resumed else chunk(ChunkDelta(role="assistant", content=""))
    return SSEStream(flight, template, frames, opening)


def stream_completion(flight: Flight, *, offset: int = 0) -> SSEStream:
    """`offset`: characters already sent (a stream continued by a takeover, gateway/streams/holder.py)."""
    prepared = flight.prepared
    sampling = prepared.request.sampling
    template = _template(flight, CompletionChunk)
    text_event = _TextEvent(
        sse(replace(template, choices=[CompletionChoice(index=0, text="", logprobs=None, finish_reason=None)])),
        b'"text":""')
    # offset: of the next delta's text in the whole completion

    def frames(delta: RequestDelta) -> Iterator[bytes]:
        nonlocal offset
        logprobs = None
        if sampling.logprobs and delta.logprobs:
            logprobs = completion_logprobs(prepared.tokenizer, delta.logprobs, sampling.top_logprobs, offset)
        if logprobs is None and delta.finish_reason is None:
            if delta.text:
                yield text_event.with_text(delta.text)
                offset += len(delta.text)
        else:
            choice = CompletionChoice(
                index=0, text=delta.text, logprobs=logprobs, finish_reason=_finish(delta.finish_reason)
            )
            yield sse(replace(template, choices=[choice]))
            offset += len(delta.text)

    return SSEStream(flight, template, frames)


# ---- whole responses ---------------------------------------------------------------------------


async def _collect(flight: Flight) -> tuple[str, tuple[PositionLogprobs, ...]]:
    """The whole text and every position's logprobs, once the request has ended."""
    texts: list[str] = []
    positions: list[PositionLogprobs] = []
    aborted = True
    try:
        async for delta in flight.deltas():
            flight.observe(delta)
            texts.append(delta.text)
            positions.extend(delta.logprobs)
        aborted = False
    except asyncio.CancelledError:
        raise
    finally:
        flight.finish(aborted=aborted and flight.finish_reason is None)
    await flight.settled()  # before the answer: the client's next request finds this one ended
    if flight.finish_reason == FinishReason.ERROR:
        raise OpenAIError(500, _failure_message(flight), type="server_error", code="generation_failed")
    return "".join(texts), tuple(positions)


async def complete_chat(flight: Flight) -> ChatCompletion:
    text, positions = await _collect(flight)
    prepared = flight.prepared
    sampling = prepared.request.sampling
    logprobs = None
    if sampling.logprobs:
        logprobs = ChoiceLogprobs(content=chat_logprobs(prepared.tokenizer, positions, sampling.top_logprobs))
    choice = ChatChoice(
        index=0, message=AssistantMessage(content=text), logprobs=logprobs, finish_reason=flight.finish_reason
    )
    return ChatCompletion(**_envelope(flight), choices=[choice], usage=_usage(flight))


async def complete_text(flight: Flight) -> Completion:
    text, positions = await _collect(flight)
    prepared = flight.prepared
    sampling = prepared.request.sampling
    logprobs = None
    if sampling.logprobs:
        logprobs = completion_logprobs(prepared.tokenizer, positions, sampling.top_logprobs, 0)
    choice = CompletionChoice(index=0, text=text, logprobs=logprobs, finish_reason=flight.finish_reason)
    return Completion(**_envelope(flight), choices=[choice], usage=_usage(flight))
