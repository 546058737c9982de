"""Tool calls out of model text (generation/tool_parsers.py): the streamed pieces assemble, in the
official `openai` SDK's own stream accumulator, into exactly the whole answer's calls, however the
text is split across deltas; the stream's chunks are the framer's (streams/frames.py)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import cast

import msgspec
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from sluice.gateway.generation.state import Envelope, RequestState
from sluice.gateway.generation.tokenization import ModelTokenizer
from sluice.gateway.generation.tool_parsers import ToolCallParser, parse_whole
from sluice.gateway.streams.frames import Framer
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams

pytestmark = pytest.mark.unit

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Rive\\" {Gauche}", '
          '"days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>')
CALLS = [("get_weather", {"city": 'Paris "Rive" {Gauche}', "days": [1, 2]}), ("get_time", {})]


def _calls(calls: list[object]) -> list[tuple[str, object]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]  # type: ignore[attr-defined]


def test_whole_answers_per_family() -> None:
    content, calls = parse_whole(HERMES, "hermes", "chatcmpl-1")
    assert content == "Let me check.\n" and _calls(calls) == CALLS  # type: ignore[arg-type]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2
    mistral = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
               '{"name": "get_time", "arguments": {}}]')
    content, calls = parse_whole(mistral, "mistral", "chatcmpl-1")
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]  # type: ignore[arg-type]
    content, calls = parse_whole('{"name": "get_time", "parameters": {"tz": "UTC"}}', "llama3_json", "chatcmpl-1")
    assert content is None and _calls(calls) == [("get_time", {"tz": "UTC"})]  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["plain answer with <tool_ca", "<tool_call>not json</tool_call>", "{not a call}",
                                  "[TOOL_CALLS] nope"])
def test_text_that_is_not_a_call_stays_content(text: str) -> None:
    for fmt in ("hermes", "llama3_json", "mistral"):
        content, calls = parse_whole(text, fmt, "r")  # type: ignore[arg-type]
        assert calls == [] and content == text, fmt


@pytest.mark.parametrize("seed", range(8))
def test_streamed_pieces_assemble_to_the_whole_answer(seed: int) -> None:
    rng = random.Random(seed)
    parser = ToolCallParser("hermes", "chatcmpl-1")
    content, args, names = "", {0: "", 1: ""}, {}
    pos = 0
    while pos < len(HERMES):
        step = rng.randint(1, 9)
        parsed = parser.feed(HERMES[pos:pos + step])
        pos += step
        content += parsed.content
        for delta in parsed.calls:
            if delta.function.name is not msgspec.UNSET:
                names[delta.index] = delta.function.name
            args[delta.index] += delta.function.arguments
    assert parser.finish().content == ""
    assert content.startswith("Let me check.\n")
    assert [(names[i], json.loads(args[i])) for i in (0, 1)] == CALLS


def _state(fmt: str) -> RequestState:
    request = GenerateRequest(request_id="chatcmpl-1", tenant_id="t", model="m", priority=Priority.STANDARD,
                              prompt_token_ids=(1,), sampling=SamplingParams(max_tokens=64), cache_salt="t",
                              arrival_time=time.time(), tool_format=fmt)
    envelope = Envelope(id="chatcmpl-1", created=7, model="m", service_tier="default", endpoint="chat")
    return RequestState(request=request, envelope=envelope, tenant_name="t", stream=True)


@pytest.mark.parametrize("fmt,text", [("hermes", HERMES), ("mistral", '[TOOL_CALLS][{"name": "get_weather", '
                                      '"arguments": {"city": "Paris \\"Rive\\" {Gauche}", "days": [1, 2]}}, '
                                      '{"name": "get_time", "arguments": {}}]')])
def test_the_sdk_stream_accumulator_assembles_the_framed_calls(fmt: str, text: str) -> None:
    framer = Framer(_state(fmt), cast(ModelTokenizer, None))
    frames: list[bytes] = []
    opening = framer.opening()
    assert opening is not None
    frames.append(opening)
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        framer.frames(RequestDelta(request_id="chatcmpl-1", text=piece,
                                   finish_reason=FinishReason.STOP if last else None),
                      lambda frame, chars, finish: frames.append(frame))
    accumulator = ChatCompletionStreamState()
    for frame in frames:
        accumulator.handle_chunk(ChatCompletionChunk.model_validate_json(frame.removeprefix(b"data: ")))
    final = accumulator.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == CALLS
    ids = [c.id for c in choice.message.tool_calls or []]
    assert all(i and i.startswith("call_") for i in ids)


def _frames_of(framer: Framer, deltas: list[tuple[tuple[int, ...], str]], last: bool) -> list[bytes]:
    frames: list[bytes] = []
    for i, (ids, piece) in enumerate(deltas):
        finish = FinishReason.STOP if last and i == len(deltas) - 1 else None
        delta = RequestDelta(request_id="chatcmpl-1", token_ids=ids, text=piece, finish_reason=finish)
        framer.state.take_output(delta)
        framer.frames(delta, lambda frame, chars, finish: frames.append(frame))
    return frames


@pytest.mark.parametrize("cut", [0.3, 0.5, 0.8])
def test_a_stream_taken_over_mid_call_goes_on_with_the_same_calls(demo_model_dir: Path, cut: float) -> None:
    tokenizer = ModelTokenizer.load("demo", demo_model_dir)
    ids = tokenizer.encode(HERMES, add_special_tokens=False)
    texts = [tokenizer.output_text(ids[:k]) for k in range(len(ids) + 1)]
    assert texts[-1] == HERMES
    deltas = [((ids[k],), texts[k + 1][len(texts[k]):]) for k in range(len(ids))]
    split = int(len(deltas) * cut)
    first = Framer(_state("hermes"), tokenizer)
    opening = first.opening()
    assert opening is not None
    frames = [opening, *_frames_of(first, deltas[:split], last=False)]
    # The replica that takes over: the state as the log holds it (rebuild), a resumed framer.
    state = _state("hermes")
    state.output_token_ids = [t for (t,), _ in deltas[:split]]
    frames += _frames_of(Framer(state, tokenizer, resumed=True), deltas[split:], last=True)
    accumulator = ChatCompletionStreamState()
    for frame in frames:
        accumulator.handle_chunk(ChatCompletionChunk.model_validate_json(frame.removeprefix(b"data: ")))
    message = accumulator.get_final_completion().choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == CALLS
    _, whole = parse_whole(HERMES, "hermes", "chatcmpl-1")
    assert [c.id for c in message.tool_calls or []] == [c.id for c in whole]


def test_mistral_calls_without_their_special_token() -> None:
    content, calls = parse_whole('[{"name": "get_time", "arguments": {"tz": "UTC"}}]', "mistral", "r")
    assert content is None and _calls(calls) == [("get_time", {"tz": "UTC"})]  # type: ignore[arg-type]
    content, calls = parse_whole("[not calls]", "mistral", "r")
    assert content == "[not calls]" and calls == []
