"""The in-process stream log and the header rules of resumable streams: pure logic, no network."""

from __future__ import annotations

import asyncio
import gc
import time
from types import SimpleNamespace
from typing import cast

import pytest
from sluice_testing import MemoryUsage

from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.generation.flight import Flight
from sluice.gateway.generation.service import GenerationService
from sluice.gateway.generation.state import Envelope, RequestState, RequestTable
from sluice.gateway.generation.tokenization import ModelTokenizer
from sluice.gateway.queueing.backend import QueuedSubmission
from sluice.gateway.streams.frames import Framer
from sluice.gateway.streams.hub import (
    ABANDONED,
    INTERRUPTED,
    StreamHub,
    check_idempotency_key,
    disconnect_grace,
    parse_last_event_id,
)
from sluice.gateway.streams.local_log import LocalStreamLog
from sluice.gateway.streams.log import Keyed, LogTrimmed
from sluice.protocol import GenerateRequest, Priority, SamplingParams

pytestmark = pytest.mark.unit


async def test_reads_after_a_seq_wait_for_the_next_event_and_see_the_end() -> None:
    log = LocalStreamLog()
    assert await log.create("r1", "tenant-a", None) is None
    for frame in (b"a", b"b", b"c"):
        log.append("r1", frame)
    page = await log.read("r1", 0, wait_s=0)
    assert page is not None and (page.first, page.frames, page.ended) == (1, [b"b", b"c"], False)
    waiting = asyncio.ensure_future(log.read("r1", 2, wait_s=30))
    await asyncio.sleep(0)
    log.append("r1", b"d")
    page = await waiting
    assert page is not None and (page.first, page.frames) == (3, [b"d"])
    log.end("r1")
    log.append("r1", b"after the end")  # ignored
    page = await log.read("r1", 3, wait_s=30)
    assert page is not None and page.frames == [] and page.ended
    assert await log.owner("r1") == "tenant-a" and await log.owner("nope") is None
    assert await log.read("nope", -1, wait_s=0) is None


async def test_a_read_with_no_event_returns_empty_by_its_wait_and_a_shorter_wait_is_not_held_up() -> None:
    log = LocalStreamLog()
    await log.create("r", "t", None)
    loop = asyncio.get_running_loop()
    started = loop.time()
    long = asyncio.ensure_future(log.read("r", -1, wait_s=30))
    short = asyncio.ensure_future(log.read("r", -1, wait_s=0.05))
    page = await asyncio.wait_for(short, 5)  # a later, shorter wait: its own deadline, not the first's
    assert page is not None and (page.frames, page.ended) == ([], False)
    assert loop.time() - started < 5
    log.append("r", b"a")  # the longer wait may have been released with it: either way, nothing is lost
    page = await asyncio.wait_for(long, 5)
    if page is not None and not page.frames:
        page = await log.read("r", -1, wait_s=0)
    assert page is not None and page.frames == [b"a"]
    for _ in range(3):  # a cancelled read leaves no waiter behind
        reader = asyncio.ensure_future(log.read("r", 0, wait_s=30))
        await asyncio.sleep(0)
        reader.cancel()
    log.end("r")
    page = await log.read("r", 0, wait_s=30)
    assert page is not None and page.ended


async def test_the_bound_trims_the_front_and_a_read_into_the_gap_says_so() -> None:
    log = LocalStreamLog(max_events=3)
    await log.create("r", "t", None)
    for i in range(5):
        log.append("r", b"%d" % i)
    page = await log.read("r", 1, wait_s=0)
    assert page is not None and page.frames == [b"2", b"3", b"4"]
    with pytest.raises(LogTrimmed):
        await log.read("r", 0, wait_s=0)


async def test_an_ended_response_is_kept_out_of_the_collectors_sight() -> None:
    # Thousands of ended responses are kept for resumption: a full collection must not walk their
    # events (it runs with the GIL held, on the gateway's loop).
    log = LocalStreamLog()
    await log.create("r1", "tenant-a", None)
    for frame in (b"a", b"b", b"c"):
        log.append("r1", frame)
    log.end("r1")
    log.append("r1", b"late")  # ignored: the response ended
    gc.collect()
    frames = log._entries["r1"].frames
    assert frames == (b"a", b"b", b"c") and not gc.is_tracked(frames)
    page = await log.read("r1", 0, wait_s=0)
    assert page is not None and (page.first, page.frames, page.ended) == (1, [b"b", b"c"], True)


async def test_keys_are_per_tenant_and_expire_with_the_response() -> None:
    log = LocalStreamLog(retention_s=0.05)
    assert await log.create("r1", "a", "k") is None
    assert await log.create("r2", "a", "k") == Keyed("r1")  # same tenant, same key: the first response
    assert await log.create("r3", "b", "k") is None  # another tenant's key is its own
    assert await log.by_key("a", "k") == Keyed("r1")
    log.end("r1")
    await asyncio.sleep(0.1)
    assert await log.owner("r1") is None and await log.by_key("a", "k") is None
    assert await log.create("r4", "a", "k") is None  # expired: the key is free again
    await log.drop("r4", "a", "k")
    assert await log.by_key("a", "k") is None and await log.owner("r4") is None


def test_header_rules() -> None:
    assert parse_last_event_id(None, None) == (None, -1)
    assert parse_last_event_id("chatcmpl-x:7", "chatcmpl-x") == ("chatcmpl-x", 7)
    for bad in ("7", "chatcmpl-x:", ":3", "chatcmpl-x:-1", "chatcmpl-x:1e3", "chatcmpl-x:" + "9" * 13):
        with pytest.raises(OpenAIError):
            parse_last_event_id(bad, None)
    with pytest.raises(OpenAIError):
        parse_last_event_id("chatcmpl-y:1", "chatcmpl-x")
    assert disconnect_grace(None, 30) == 30 and disconnect_grace("abort", 30) == 0
    assert disconnect_grace("grace=5", 30) == 5 and disconnect_grace("grace=99", 30) == 30
    for bad in ("never", "grace=", "grace=nan", "grace=-2", "grace=inf"):
        with pytest.raises(OpenAIError):
            disconnect_grace(bad, 30)
    assert check_idempotency_key(None) is None and check_idempotency_key("k-1") == "k-1"
    for bad in ("", "x" * 256, "ключ", "a\nb"):
        with pytest.raises(OpenAIError):
            check_idempotency_key(bad)


@pytest.mark.parametrize("how", ["stop", "abandon"])
async def test_a_pump_cancelled_before_its_first_step_still_cleans_up(how: str) -> None:
    """A shutdown landing between a stream's start and its task's first step cannot be provoked at
    will with real processes: a real pump, flight and submission, with a stand-in for the service's
    usage rows, check that the cleanup (the abort at the worker, the log's end) still runs."""
    log = LocalStreamLog()
    flights: RequestTable[Flight] = RequestTable()
    usage = MemoryUsage()
    service = SimpleNamespace(flights=flights, spawn=asyncio.ensure_future, usage=usage, request_timeout_s=600.0)
    hub = StreamHub(log, flights, asyncio.ensure_future)
    await log.create("r1", "tenant-a", None)
    request = GenerateRequest(request_id="r1", tenant_id="tenant-a", model="m", priority=Priority.STANDARD,
                              prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=4), cache_salt="a",
                              arrival_time=time.time())
    state = RequestState(request=request, tenant_name="a",
                         envelope=Envelope(id="r1", created=0, model="m", service_tier="default", endpoint="chat"))
    aborted: list[str] = []
    submission = QueuedSubmission("r1", aborted.append)
    flight = Flight(cast(GenerationService, service), state, cast(TenantContext, SimpleNamespace(id="tenant-a")),
                    submission)
    flights.add("r1", flight)
    hub.start(flight, Framer(state, cast(ModelTokenizer, None)), grace_s=0.0)
    pump = hub.pump("r1")
    assert pump is not None and pump.task is not None
    if how == "stop":
        await hub.stop()  # in the step that started it: its task has not run yet
    else:
        pump.cancel()
        await asyncio.gather(pump.task, return_exceptions=True)
    await asyncio.sleep(0.01)  # the flight's end runs in the background
    assert flight.finished and aborted == ["r1"] and len(flights) == 0 and len(usage.rows) == 1
    assert state.finish_reason == "abort"
    page = await log.read("r1", -1, wait_s=0)
    assert page is not None and page.ended
    assert page.frames[1:] == [INTERRUPTED if how == "stop" else ABANDONED]
    assert page.frames[0].startswith(b'data: {"id":"r1","object":"chat.completion.chunk"')


async def test_the_in_process_log_is_bounded_by_bytes_and_forgets_keys_with_responses() -> None:
    """Issue #36 item 17: past `max_bytes` the oldest ended responses go, their keys with them; a
    live response is never dropped (max_events bounds it)."""
    log = LocalStreamLog(max_bytes=1000)
    await log.create("live", "t", "k-live")
    log.append("live", b"x" * 300)
    for i in range(3):
        await log.create(f"r{i}", "t", f"k{i}")
        log.append(f"r{i}", b"y" * 400)
        log.end(f"r{i}")
    assert log.bytes <= 1000
    assert await log.read("r0", -1, wait_s=0) is None and await log.by_key("t", "k0") is None
    assert (await log.read("r2", -1, wait_s=0)).frames == [b"y" * 400]
    assert await log.by_key("t", "k2") == Keyed("r2")
    assert (await log.read("live", -1, wait_s=0)).frames == [b"x" * 300]
    log.append("live", b"z" * 2000)  # over the bound with live bytes alone: only ended ones go
    assert await log.read("live", -1, wait_s=0) is not None and await log.by_key("t", "k-live") == Keyed("live")
