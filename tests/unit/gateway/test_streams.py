"""A streamed answer without processes: the framer's events, the pump over a hand-fed submission
(deltas folded into the state as the dispatcher folds them), and the resumer's plan and tail."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import cast

import msgspec
import pytest
from sluice_testing import MemoryUsage

from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChunkDelta,
    CompletionChunk,
    PromptTokensDetails,
    Usage,
)
from sluice.gateway.generation.flight import Flight
from sluice.gateway.generation.service import GenerationService
from sluice.gateway.generation.state import Endpoint, Envelope, RequestState, RequestTable
from sluice.gateway.generation.tokenization import ModelTokenizer
from sluice.gateway.queueing.backend import QueuedSubmission
from sluice.gateway.streams.frames import DONE, Framer, sse
from sluice.gateway.streams.holder import MAX_TAKEOVERS, Claimed
from sluice.gateway.streams.hub import StreamHub
from sluice.gateway.streams.local_log import LocalStreamLog
from sluice.gateway.streams.log import EventKind, Mark
from sluice.gateway.streams.resumer import Step, plan, rebuild, tail
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams

pytestmark = pytest.mark.unit


def _request(rid: str, max_tokens: int = 16) -> GenerateRequest:
    return GenerateRequest(request_id=rid, tenant_id="t", model="m", priority=Priority.STANDARD,
                           prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=max_tokens), cache_salt="t",
                           arrival_time=time.time())


def _state(rid: str, endpoint: Endpoint = "chat", include_usage: bool = True, max_tokens: int = 16) -> RequestState:
    envelope = Envelope(id=rid, created=7, model="m", service_tier="default", endpoint=endpoint,
                        include_usage=include_usage)
    return RequestState(request=_request(rid, max_tokens), envelope=envelope, tenant_name="t", stream=True)


def _events(frames: list[bytes]) -> list[object]:
    return [frame if frame == DONE else msgspec.json.decode(frame.removeprefix(b"data: ")) for frame in frames]


def test_chat_frames_are_the_schema_structs_encoded() -> None:
    state = _state("c1")
    framer = Framer(state, cast(ModelTokenizer, None))
    out: list[tuple[bytes, int, str | None]] = []

    def emit(frame: bytes, chars: int, finish: str | None) -> None:
        out.append((frame, chars, finish))

    def chunk(delta: ChunkDelta, finish: str | None = None) -> bytes:
        return sse(ChatCompletionChunk(id="c1", created=7, model="m", service_tier="default", usage=None,
                                       choices=[ChatChunkChoice(index=0, delta=delta, logprobs=None,
                                                                finish_reason=finish)]))

    assert framer.opening() == chunk(ChunkDelta(role="assistant", content=""))
    for delta in (RequestDelta(request_id="c1", token_ids=(5,), text="Hé", num_output_tokens=1),
                  RequestDelta(request_id="c1", token_ids=(6,), text="", num_output_tokens=2),  # half a character
                  RequestDelta(request_id="c1", token_ids=(7,), text="llo", num_output_tokens=3,
                               finish_reason=FinishReason.LENGTH, num_prompt_tokens=3)):
        state.take_output(delta)
        framer.frames(delta, emit)
    # The token that ends mid-character is an event of its own, with empty text (one event per
    # step, as vLLM streams: a client timing tokens by events sees no double gap).
    assert out == [(chunk(ChunkDelta(content="Hé")), 2, None), (chunk(ChunkDelta(content="")), 0, None),
                   (chunk(ChunkDelta(content="llo")), 3, None), (chunk(ChunkDelta(), "length"), 0, "length")]
    usage = Usage(prompt_tokens=3, completion_tokens=3, total_tokens=6,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
    assert framer.usage() == sse(ChatCompletionChunk(id="c1", created=7, model="m", service_tier="default",
                                                     choices=[], usage=usage))
    assert Framer(state, cast(ModelTokenizer, None), resumed=True).opening() is None


def test_a_completion_token_that_ends_mid_character_is_an_event_with_empty_text() -> None:
    state = _state("t2", endpoint="text", include_usage=False)
    framer = Framer(state, cast(ModelTokenizer, None))
    out: list[bytes] = []
    for delta in (RequestDelta(request_id="t2", token_ids=(5,), text="", num_output_tokens=1),
                  RequestDelta(request_id="t2", text="", num_output_tokens=1)):  # nothing at all: no event
        state.take_output(delta)
        framer.frames(delta, lambda frame, chars, finish: out.append(frame))
    [event] = _events(out)
    assert event["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]


def test_completion_frames_carry_the_finish_reason_with_the_text() -> None:
    state = _state("t1", endpoint="text", include_usage=False)
    framer = Framer(state, cast(ModelTokenizer, None))
    out: list[bytes] = []
    delta = RequestDelta(request_id="t1", token_ids=(5,), text="ok", num_output_tokens=1,
                         finish_reason=FinishReason.STOP)
    state.take_output(delta)
    framer.frames(delta, lambda frame, chars, finish: out.append(frame))
    [event] = _events(out)
    empty = msgspec.to_builtins(CompletionChunk(id="t1", created=7, model="m", service_tier="default", choices=[]))
    assert event == empty | {"choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}]}
    assert framer.opening() is None and framer.usage() is None


async def test_the_pump_logs_each_delta_at_its_delivery_and_ends_once() -> None:
    """The deltas are folded into the state and delivered as the dispatcher does it; the quota
    hold is left out (no reservation), the usage rows stand in for the database."""
    log = LocalStreamLog()
    flights: RequestTable[Flight] = RequestTable()
    service = SimpleNamespace(flights=flights, spawn=asyncio.ensure_future, usage=MemoryUsage(),
                              request_timeout_s=600.0)
    hub = StreamHub(log, flights, asyncio.ensure_future)
    state = _state("c2")
    submission = QueuedSubmission("c2", lambda rid: None)
    flight = Flight(cast(GenerationService, service), state, cast(TenantContext, SimpleNamespace(id="t")), submission)
    flights.add("c2", flight)
    await log.create("c2", "t", None)

    def deliver(delta: RequestDelta) -> None:
        state.take_output(delta)
        submission.deliver(delta)

    deliver(RequestDelta(request_id="c2", token_ids=(5,), text="a", num_output_tokens=1))  # before the pump
    hub.start(flight, Framer(state, cast(ModelTokenizer, None)), grace_s=30)
    page = await log.read("c2", -1, wait_s=0)
    assert page is not None and len(page.frames) == 2  # the opening and the first delta, logged at once
    deliver(RequestDelta(request_id="c2", token_ids=(6,), text="b", num_output_tokens=2))
    deliver(RequestDelta(request_id="c2", finish_reason=FinishReason.LENGTH, num_output_tokens=2))
    pump = hub.pump("c2")
    assert pump is not None and pump.task is not None
    await asyncio.wait_for(pump.task, 5)
    page = await log.read("c2", -1, wait_s=0)
    assert page is not None and page.ended
    events = _events(page.frames)
    assert [e["choices"][0]["delta"] for e in events[1:3]] == [{"content": "a"}, {"content": "b"}]  # type: ignore[index]
    assert events[3]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert events[4]["usage"]["completion_tokens"] == 2 and events[5] == DONE  # type: ignore[index]
    assert flight.finished and len(flights) == 0 and state.finish_reason == "length"
    assert state.num_logged_tokens == 0  # the in-process log keeps no marks: nothing is logged with ids


def _claimed(**fields: object) -> Claimed:
    envelope = Envelope(id="c3", created=7, model="m", service_tier="default", endpoint="chat", include_usage=True)
    made = Claimed("c3", "t", None, 1, 3, grace_s=30.0, envelope=envelope, token_ids=[5, 6], chars=2)
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def test_the_takeover_plan_follows_the_logged_checkpoints() -> None:
    request = _request("c3", max_tokens=16)
    assert plan(request, _claimed()) is Step.CONTINUE
    assert plan(request, _claimed(ended=True)) is Step.NOTHING
    assert plan(request, _claimed(grace_s=0.0)) is Step.ABANDON
    assert plan(request, _claimed(takeovers=MAX_TAKEOVERS + 1)) is Step.FAIL
    assert plan(request, _claimed(whole=False)) is Step.FAIL
    assert plan(request, _claimed(envelope=None)) is Step.FAIL
    assert plan(request, _claimed(final=True)) is Step.END
    assert plan(request, _claimed(finish="stop")) is Step.FINISH
    assert plan(_request("c3", max_tokens=2), _claimed()) is Step.FINISH  # every token was sent


def test_a_finished_streams_tail_is_written_from_its_state() -> None:
    claimed = _claimed()
    assert claimed.envelope is not None
    state = rebuild(_request("c3", max_tokens=2), claimed.envelope, claimed)
    assert state.request.resume_token_ids == (5, 6) and state.num_logged_tokens == 2 and state.text_chars == 2
    events = tail(claimed, Framer(state, cast(ModelTokenizer, None), resumed=True))
    assert [mark.kind for _, mark in events] == [EventKind.CHUNK, EventKind.USAGE, EventKind.DONE]
    assert events[0][1] == Mark(EventKind.CHUNK, b"", 0, "length")
    finishing, usage, _ = _events([frame for frame, _ in events])
    assert finishing["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,  # type: ignore[index]
                              "prompt_tokens_details": {"cached_tokens": 0}}
    # The finishing chunk and the usage went out before the replica was lost: only [DONE] is missing.
    assert [f for f, _ in tail(_claimed(finish="stop", usage_sent=True), Framer(state, None))] == [DONE]  # type: ignore[arg-type]
