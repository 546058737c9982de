"""A text delta's SSE event put together from the pre-encoded chunk (gateway/streams/frames.py) is
byte for byte the event of the whole chunk encoded."""

from __future__ import annotations

import msgspec
import pytest

from sluice.gateway.edge.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChunkDelta,
    CompletionChoice,
    CompletionChunk,
)
from sluice.gateway.streams.frames import _TextEvent, sse

TEXTS = [" tok", "", 'a "quoted" \\ back', "line\nbreak\ttab\x00nul", "é漢字🙂", '"content":""', "\u2028"]


@pytest.mark.parametrize("usage", [None, msgspec.UNSET])
def test_chat_text_event_is_the_encoded_chunk(usage: object) -> None:
    template = ChatCompletionChunk(id="chatcmpl-1", created=7, model='m"content":""', service_tier="default",
                                   choices=[], usage=usage)  # type: ignore[arg-type]

    def whole(text: str) -> bytes:
        choice = ChatChunkChoice(index=0, delta=ChunkDelta(content=text), logprobs=None, finish_reason=None)
        return sse(msgspec.structs.replace(template, choices=[choice]))

    event = _TextEvent(whole(""), b'"content":""')
    for text in TEXTS:
        assert event.with_text(text) == whole(text)


def test_completion_text_event_is_the_encoded_chunk() -> None:
    template = CompletionChunk(id="cmpl-1", created=7, model="m", service_tier="flex", choices=[], usage=None)

    def whole(text: str) -> bytes:
        choice = CompletionChoice(index=0, text=text, logprobs=None, finish_reason=None)
        return sse(msgspec.structs.replace(template, choices=[choice]))

    event = _TextEvent(whole(""), b'"text":""')
    for text in TEXTS:
        assert event.with_text(text) == whole(text)
