"""The SSE stream of an answer of n > 1 choices without processes (streams/choices.py): hand-fed
submissions, one per choice, whose deltas are folded into each choice's state as the dispatcher
folds them."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
from sluice_testing import MemoryUsage

from sluice.gateway.auth.service import TenantContext
from sluice.gateway.generation.flight import Flight
from sluice.gateway.generation.service import GenerationService
from sluice.gateway.generation.state import Envelope, RequestState, RequestTable
from sluice.gateway.generation.tokenization import ModelTokenizer
from sluice.gateway.queueing.backend import QueuedSubmission
from sluice.gateway.streams.choices import ChoicesStream
from sluice.gateway.streams.frames import DONE
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams

pytestmark = pytest.mark.unit


class Answer:
    """n choices in flight, each on a submission the test feeds; `aborted` lists those aborted."""

    def __init__(self, n: int) -> None:
        self.aborted: list[str] = []
        self.usage = MemoryUsage()
        service = SimpleNamespace(flights=RequestTable(), spawn=asyncio.ensure_future, usage=self.usage,
                                  request_timeout_s=600.0)
        envelope = Envelope(id="a", created=1, model="m", service_tier="default", endpoint="chat",
                            include_usage=True, choices=n)
        self.flights: list[Flight] = []
        for i in range(n):
            rid = "a" if i == 0 else f"a-{i}"
            request = GenerateRequest(request_id=rid, tenant_id="t", model="m", priority=Priority.STANDARD,
                                      prompt_token_ids=(1, 2, 3, 4), sampling=SamplingParams(max_tokens=8),
                                      cache_salt="t", arrival_time=time.time())
            state = RequestState(request=request, envelope=envelope, tenant_name="t", stream=True,
                                 bills_request=i == 0)
            submission = QueuedSubmission(rid, self.aborted.append)
            flight = Flight(cast(GenerationService, service), state, cast(TenantContext, SimpleNamespace(id="t")),
                            submission)
            service.flights.add(rid, flight)
            self.flights.append(flight)

    def deliver(self, index: int, text: str = "", finish: FinishReason | None = None) -> None:
        flight = self.flights[index]
        state = flight.state
        tokens = (7,) if text else ()
        delta = RequestDelta(request_id=state.request_id, token_ids=tokens, text=text, finish_reason=finish,
                             num_prompt_tokens=4, num_output_tokens=state.num_output_tokens + len(tokens),
                             error="boom" if finish is FinishReason.ERROR else None)
        state.take_output(delta)
        cast(QueuedSubmission, flight.submission).deliver(delta)

    def stream(self) -> ChoicesStream:
        return ChoicesStream(self.flights, cast(ModelTokenizer, None))


async def _read(stream: ChoicesStream) -> list[Any]:
    body = b"".join([chunk async for chunk in stream])
    return [e if e == b"[DONE]" else msgspec.json.decode(e) for e in
            (part.removeprefix(b"data: ") for part in body.split(b"\n\n") if part)]


async def test_choices_interleave_by_arrival_each_with_its_finish_then_one_usage() -> None:
    answer = Answer(2)
    answer.deliver(1, "x")  # before the stream starts (its first delta before the first byte)
    reader = asyncio.ensure_future(_read(answer.stream()))
    await asyncio.sleep(0)  # reading: the rest go out as they come
    answer.deliver(0, "y")
    answer.deliver(1, "z", FinishReason.LENGTH)
    answer.deliver(0, "", FinishReason.STOP)
    events = await asyncio.wait_for(reader, 5)
    choices = [(c["index"], c["delta"].get("content"), c["finish_reason"]) for e in events[:-2] for c in e["choices"]]
    assert choices == [(0, "", None), (1, "", None),  # each choice's role chunk
                       (1, "x", None), (0, "y", None), (1, "z", None), (1, None, "length"), (0, None, "stop")]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["prompt_tokens"] == 4  # the prompt once
    assert events[-2]["usage"]["completion_tokens"] == 3 and events[-1] == b"[DONE]"
    assert all(f.finished for f in answer.flights) and not answer.aborted
    await asyncio.sleep(0)  # the usage rows are written in the background
    assert sorted(answer.usage.rows) == [("t", "m", 0, 2, 0), ("t", "m", 4, 1, 1)]  # the request once


async def test_a_failing_choice_ends_the_stream_and_aborts_the_others() -> None:
    answer = Answer(3)
    answer.deliver(2, "x")
    answer.deliver(1, "", FinishReason.ERROR)
    events = await asyncio.wait_for(_read(answer.stream()), 5)
    assert "error" in events[-1] and DONE not in events
    await asyncio.sleep(0)
    assert sorted(answer.aborted) == ["a", "a-2"]  # not the failed one: it ended at its worker


async def test_a_client_gone_before_the_first_byte_aborts_every_choice() -> None:
    answer = Answer(2)
    await answer.stream().aclose()  # never read: as the response does when its client left first
    await asyncio.sleep(0)
    assert sorted(answer.aborted) == ["a", "a-1"] and all(f.finished for f in answer.flights)
