"""The SSE events of a streamed answer, one function of (state, delta), built from the schema structs.

A `Framer` is made once per stream from the request's state (its envelope: id, created, model,
service tier, endpoint, include_usage); `frames(delta, emit)` then passes each event of one delta to
`emit` with what it adds to the stream (text characters, a finish reason), and `usage()`, `error()`
and `timeout()` give the stream's last events. The pump (streams/hub.py) logs them; a replica that
takes a stream over (streams/resumer.py) writes the missing end of a stream with the same framer.

Events are pre-encoded bytes (`data: <json>\\n\\n`): msgspec JSON never contains a raw newline, so
one `data:` line per event is always valid. Every chunk is a copy of a template chunk with its own
choices (`replace` is several times cheaper than building a chunk from keyword arguments), and the
event of a delta that is text alone, the most frequent by far, is the template encoded once with
empty text and the text's JSON string put in its place (`_TextEvent`).

Every delta that carries output tokens is an event, even when its text is empty (a token that ends
inside a character, whose text comes with the next one): one event per engine step, as vLLM streams.
Clients that time tokens by events (`vllm bench serve`'s ITL) would otherwise see the gap before
such a token and the one after it as one gap of twice the length.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from msgspec.structs import replace

from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.edge.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkDelta,
    CompletionChoice,
    CompletionChunk,
    Usage,
)
from sluice.gateway.generation.answers import chat_logprobs, completion_logprobs, failure_body, usage
from sluice.gateway.generation.state import RequestState
from sluice.gateway.generation.tokenization import ModelTokenizer
from sluice.gateway.generation.tool_parsers import ToolCallParser, tool_calls_finish
from sluice.protocol import FinishReason, RequestDelta

_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"

# emit(frame, characters of output text in it, the finish reason its choice carries)
Emit = Callable[[bytes, int, str | None], None]


def sse(payload: msgspec.Struct | dict[str, object]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


class _TextEvent:
    """The event of a delta that is text alone: this stream's one chunk encoded once with empty
    text, and the text's JSON string put in its place per delta. The same bytes as encoding the
    whole chunk each time (msgspec writes a string the same way alone as inside a struct), for one
    short string instead of the envelope's structs and fields."""

    __slots__ = ("_head", "_tail")

    def __init__(self, empty: bytes, field: bytes) -> None:
        # The text field is the choice's, after the envelope's strings (id, model) in the chunk.
        at = empty.rindex(field) + len(field) - 2  # just before its empty string ""
        self._head, self._tail = empty[:at], empty[at + 2 :]

    def with_text(self, text: str) -> bytes:
        return self._head + _encode(text) + self._tail


class Framer:
    """The SSE events of one streamed answer's choice (module docstring). `resumed`: it continues a
    stream whose earlier events another replica sent (no second role chunk); `index`: the choice's
    index in an answer of n > 1 choices (streams/choices.py)."""

    __slots__ = ("_chars", "_chat", "_index", "_template", "_text_event", "_tools", "resumed", "state", "tokenizer")

    def __init__(self, state: RequestState, tokenizer: ModelTokenizer, *, resumed: bool = False,
                 index: int = 0) -> None:
        self.state = state
        self._index = index
        self.tokenizer = tokenizer
        self.resumed = resumed
        # Characters of the completion framed so far (text offsets of completion logprobs), counted
        # here: the deltas that came before the stream's listener are framed after the state folded
        # them all in, so its running count is ahead of the delta being framed. A resumed stream
        # goes on after the text its log holds.
        self._chars = state.text_chars if resumed else 0
        envelope = state.envelope
        self._chat = envelope.endpoint == "chat"
        # A request with tools: its text goes through the family's parser (content and tool_calls
        # deltas). A stream resumed on another replica primes its parser with the text of the
        # tokens the log holds (what the lost replica's parser had read), so a call half-streamed
        # there goes on here, under the same ids.
        fmt = state.request.tool_format
        self._tools = None
        if self._chat and fmt is not None:
            self._tools = ToolCallParser(fmt, state.request_id)  # type: ignore[arg-type]
            if resumed and state.output_token_ids:
                self._tools.feed(tokenizer.output_text(state.output_token_ids))
        # Its usage is null on every chunk when include_usage is set (only the last carries it), else absent.
        chunk_usage = None if envelope.include_usage else msgspec.UNSET
        self._template: ChatCompletionChunk | CompletionChunk
        if self._chat:
            self._template = ChatCompletionChunk(id=envelope.id, created=envelope.created, model=envelope.model,
                                                 service_tier=envelope.service_tier, choices=[], usage=chunk_usage)
            self._text_event = _TextEvent(self._chat_chunk(ChunkDelta(content="")), b'"content":""')
        else:
            self._template = CompletionChunk(id=envelope.id, created=envelope.created, model=envelope.model,
                                             service_tier=envelope.service_tier, choices=[], usage=chunk_usage)
            self._text_event = _TextEvent(self._text_chunk("", None, None), b'"text":""')

    def _chat_chunk(self, delta: ChunkDelta, finish: str | None = None,
                    logprobs: ChoiceLogprobs | None = None) -> bytes:
        choice = ChatChunkChoice(index=self._index, delta=delta, logprobs=logprobs, finish_reason=finish)
        return sse(replace(self._template, choices=[choice]))

    def _text_chunk(self, text: str, finish: str | None, logprobs: object) -> bytes:
        choice = CompletionChoice(index=self._index, text=text, logprobs=logprobs,  # type: ignore[arg-type]
                                  finish_reason=finish)
        return sse(replace(self._template, choices=[choice]))

    def opening(self) -> bytes | None:
        """OpenAI's first chat chunk names the role (a resumed stream sent it already)."""
        if self._chat and not self.resumed:
            return self._chat_chunk(ChunkDelta(role="assistant", content=""))
        return None

    def frames(self, delta: RequestDelta, emit: Emit) -> None:
        """The events of one delta (folded into the state already). An error's event is `error()`."""
        text = delta.text
        offset = self._chars  # of this delta's text in the whole completion
        self._chars += len(text)
        finish = None if delta.finish_reason is None else str(delta.finish_reason)
        sampling = self.state.request.sampling
        with_logprobs = sampling.logprobs and bool(delta.logprobs)
        if self._tools is not None:
            self._tool_frames(delta, finish, emit)
            return
        if self._chat:
            if with_logprobs:
                logprobs = ChoiceLogprobs(content=chat_logprobs(self.tokenizer, delta.logprobs, sampling.top_logprobs))
                emit(self._chat_chunk(ChunkDelta(content=text), None, logprobs), len(text), None)
            elif text or delta.token_ids:
                emit(self._text_event.with_text(text), len(text), None)
            if finish is not None:
                emit(self._chat_chunk(ChunkDelta(), finish), 0, finish)
            return
        if not with_logprobs and finish is None:
            if text or delta.token_ids:
                emit(self._text_event.with_text(text), len(text), None)
            return
        text_logprobs = None
        if with_logprobs:
            text_logprobs = completion_logprobs(self.tokenizer, delta.logprobs, sampling.top_logprobs, offset)
        emit(self._text_chunk(text, finish, text_logprobs), len(text), finish)

    def _tool_frames(self, delta: RequestDelta, finish: str | None, emit: Emit) -> None:
        """A chat delta of a request with tools: content, then tool-call pieces, then the finish."""
        assert self._tools is not None  # for the type checker: only called with a parser
        sampling = self.state.request.sampling
        parsed = self._tools.feed(delta.text)
        if finish is not None:
            end = self._tools.finish()
            parsed.content += end.content
            parsed.calls += end.calls
            if self._tools.num_calls:
                finish = tool_calls_finish(finish)
        if sampling.logprobs and delta.logprobs:
            logprobs = ChoiceLogprobs(content=chat_logprobs(self.tokenizer, delta.logprobs, sampling.top_logprobs))
            emit(self._chat_chunk(ChunkDelta(content=parsed.content), None, logprobs), len(delta.text), None)
        elif parsed.content:
            emit(self._text_event.with_text(parsed.content), len(delta.text), None)
        if parsed.calls:
            # characters are counted with the content: the delta's text is emitted by now, as content or calls
            emit(self._chat_chunk(ChunkDelta(tool_calls=parsed.calls)), 0, None)
        if finish is not None:
            emit(self._chat_chunk(ChunkDelta(), finish), 0, finish)

    def finishing(self, reason: FinishReason, emit: Emit) -> None:
        """The finishing chunk of a stream whose last delta's events were lost with its replica."""
        self.frames(RequestDelta(request_id=self.state.request_id, finish_reason=reason), emit)

    def usage(self, total: Usage | None = None) -> bytes | None:
        """The chunk with no choices that carries the usage, when the stream asked for it; `total`:
        the whole answer's, when it has several choices (else this choice's)."""
        if not self.state.envelope.include_usage:
            return None
        return sse(replace(self._template, usage=usage(self.state) if total is None else total))

    def error(self) -> bytes:
        """The event that ends a stream whose generation failed (no [DONE] follows)."""
        return sse(failure_body(self.state))

    @staticmethod
    def failed(exc: OpenAIError) -> bytes:
        """The event that ends a stream with this error (a timeout after the first byte, say)."""
        return sse(exc.body())
