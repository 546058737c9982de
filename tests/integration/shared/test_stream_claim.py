"""Replica takeover's claim (gateway/streams/holder.py) on the real Redis: of replicas racing for a
stream whose generator's lease ran out, exactly one claims it; a stream whose generator is alive,
one that ended, and one whose log is gone are never claimed; the claimer reads back the token ids
logged with the events; held records are finished once their streams end; a pump's typed marks
let a taker rebuild the stream's state."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

import pytest
from aiokafka import TopicPartition
from redis.asyncio import Redis
from sluice_testing import MemoryUsage

from sluice.gateway.auth.service import TenantContext
from sluice.gateway.generation.flight import Flight
from sluice.gateway.generation.service import GenerationService
from sluice.gateway.generation.state import Envelope, RequestState, RequestTable
from sluice.gateway.generation.tokenization import ModelTokenizer
from sluice.gateway.queueing.backend import QueuedSubmission
from sluice.gateway.queueing.consumer import RecordRef
from sluice.gateway.quotas.redis_ledger import RedisLedger
from sluice.gateway.streams.frames import Framer
from sluice.gateway.streams.holder import ALIVE, CLAIMED, ENDED, GONE, Claimed, StreamHolder
from sluice.gateway.streams.hub import StreamHub
from sluice.gateway.streams.log import EventKind, Mark, pack_tokens
from sluice.gateway.streams.redis_log import RedisStreamLog
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams

pytestmark = [pytest.mark.integration]

LEASE_S = 30.0  # leases are given up explicitly here, never left to run out


def _mark(*tokens: int) -> Mark:
    """A chunk's checkpoint: the output token ids first sent with it."""
    return Mark(EventKind.CHUNK, pack_tokens(tokens))


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, tenant_id="t", model="demo", priority=Priority.STANDARD,
                           prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=50), cache_salt="t",
                           arrival_time=0.0)


async def _replica(redis: Redis, prefix: str, name: str) -> tuple[RedisLedger, RedisStreamLog]:
    lease = RedisLedger(redis, prefix=prefix, lease_s=LEASE_S, replica=name)
    await lease.refresh()  # its lease in P:replicas
    stream_log = RedisStreamLog(redis, prefix=prefix, replica=name)
    await stream_log.start()
    return lease, stream_log


def _holder(redis: Redis, stream_log: RedisStreamLog, prefix: str, finished: list[RecordRef], *,
            gone_after_s: float = 0.0) -> StreamHolder:
    return StreamHolder(redis, stream_log, prefix=prefix, replica=stream_log.replica, finish=finished.append,
                        current=lambda ref: True, gone_after_s=gone_after_s)


class _Resumer:
    """Records the streams it is handed; `ready` stands for "a worker for its model has linked"."""

    def __init__(self, ready: bool = True) -> None:
        self.ready = ready
        self.resumed: list[tuple[str, Claimed]] = []

    def can_continue(self, request: GenerateRequest) -> bool:
        return self.ready

    async def __call__(self, request: GenerateRequest, claimed: Claimed) -> None:
        self.resumed.append((request.request_id, claimed))


async def test_exactly_one_replica_claims_an_orphaned_stream_and_never_an_ended_one(redis: Redis, prefix: str) -> None:
    acceptor, accepted = await _replica(redis, prefix, "acceptor")
    takers = [await _replica(redis, prefix, f"taker-{i}") for i in range(4)]
    finished: list[RecordRef] = []
    holders = [_holder(redis, stream_log, prefix, finished) for _, stream_log in takers]
    try:
        for rid in ("chatcmpl-open", "chatcmpl-ended"):
            assert await accepted.create(rid, "t", "key-" + rid) is None
            accepted.append(rid, b"data: {\"n\":0}\n\n")
            accepted.append(rid, b"data: {\"n\":1}\n\n", _mark(11, 12))
            accepted.append(rid, b"data: {\"n\":2}\n\n")
            accepted.append(rid, b"data: {\"n\":3}\n\n", _mark(13))
        accepted.end("chatcmpl-ended")
        await accepted.flushed()

        # Its generator's lease is live: nobody may claim it.
        assert {await h.claim("chatcmpl-open") for h in holders} == {(ALIVE, 0)}
        await acceptor.stop()  # gives the lease up now, as a SIGKILL lets it run out
        answers = await asyncio.gather(*(h.claim("chatcmpl-open") for h in holders))
        winners = [h for h, (state, _) in zip(holders, answers, strict=True) if state == CLAIMED]
        assert len(winners) == 1, answers
        assert sorted(answers) == sorted([(CLAIMED, 1)] + [(ALIVE, 0)] * 3)  # the others see the claimer alive
        claimed = await winners[0].read("chatcmpl-open", 1)
        assert (claimed.tenant, claimed.next_seq, claimed.token_ids, claimed.whole, claimed.ended) == (
            "t", 4, [11, 12, 13], True, False)
        assert claimed.key is not None and claimed.key.startswith(f"{prefix}:sk:t:")

        # Ended (its generator lost too): never claimed. Unknown: gone.
        assert {await h.claim("chatcmpl-ended") for h in holders} == {(ENDED, 0)}
        assert {await h.claim("chatcmpl-unknown") for h in holders} == {(GONE, 0)}

        # The winner's lease runs out in turn: the next claim is the second takeover.
        winner_lease = takers[holders.index(winners[0])][0]
        await winner_lease.stop()
        others = [h for h in holders if h is not winners[0]]
        answers = await asyncio.gather(*(h.claim("chatcmpl-open") for h in others))
        assert sorted(state for state, _ in answers) == [ALIVE, ALIVE, CLAIMED]
        assert max(n for _, n in answers) == 2
    finally:
        await accepted.stop()
        for lease, stream_log in takers:
            await stream_log.stop()
            await lease.stop()


async def test_held_records_are_finished_at_the_end_and_an_orphan_is_resumed_once(redis: Redis, prefix: str) -> None:
    acceptor, accepted = await _replica(redis, prefix, "acceptor")
    takers = [await _replica(redis, prefix, f"taker-{i}") for i in range(2)]
    finished: list[RecordRef] = []
    holders = [_holder(redis, stream_log, prefix, finished) for _, stream_log in takers]
    resumer = _Resumer()
    resumed = resumer.resumed
    for holder in holders:
        holder.bind(resumer)
    refs = {rid: RecordRef(Priority.STANDARD, TopicPartition("t", 0), offset)
            for offset, rid in enumerate(("chatcmpl-a", "chatcmpl-b", "cmpl-not-a-stream"))}
    try:
        for rid in ("chatcmpl-a", "chatcmpl-b"):
            await accepted.create(rid, "t", None)
            accepted.append(rid, b"data: {}\n\n", _mark(7))
        await accepted.flushed()
        for holder in holders:  # both hold every record (a rebalance moved the partition meanwhile)
            for rid, ref in refs.items():
                holder.hold(_request(rid), ref)
        await asyncio.gather(*(h.check() for h in holders))
        assert all(f is refs["cmpl-not-a-stream"] for f in finished) and len(finished) == 2  # no log: not a stream
        assert resumed == [] and all(h.held == 2 for h in holders)  # their generator is alive

        accepted.end("chatcmpl-a")
        await accepted.flushed()
        await acceptor.stop()
        await asyncio.gather(*(h.check() for h in holders))
        for _ in range(100):  # the claims run in tasks of their own
            if resumed:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert [rid for rid, _ in resumed] == ["chatcmpl-b"]  # one claim of the orphan, none of the ended one
        assert resumed[0][1].token_ids == [7] and resumed[0][1].next_seq == 1
        assert sum(f is refs["chatcmpl-a"] for f in finished) == 2  # ended: released by both
        assert all(h.held == 1 for h in holders)  # the orphan's record stays held until its log ends
    finally:
        for holder in holders:
            await holder.stop()
        await accepted.stop()
        for lease, stream_log in takers:
            await stream_log.stop()
            await lease.stop()


async def test_an_event_is_shown_here_only_once_it_is_in_redis(redis: Redis, prefix: str) -> None:
    """A client must never hold an event a taker cannot see (its continuation would be other chunks)."""
    stream_log = RedisStreamLog(redis, prefix=prefix, replica="r")
    await stream_log.start()
    try:
        await stream_log.create("chatcmpl-x", "t", None)
        stream_log.append("chatcmpl-x", b"data: {}\n\n", _mark(5, 6))
        page = await stream_log.read("chatcmpl-x", -1, wait_s=0)  # the flusher has not run yet
        assert page is not None and page.frames == []
        page = await stream_log.read("chatcmpl-x", -1, wait_s=5)  # woken by the write
        assert page is not None and page.frames == [b"data: {}\n\n"]
        assert len(await redis.xrange(f"{prefix}:sl:chatcmpl-x")) == 1
        stream_log.end("chatcmpl-x")
        page = await stream_log.read("chatcmpl-x", 0, wait_s=5)
        assert page is not None and page.ended
    finally:
        await stream_log.stop()


async def test_a_record_is_held_while_its_stream_is_not_filed_yet_and_claimed_only_when_it_can_run(
        redis: Redis, prefix: str) -> None:
    """The acceptor files a stream right after its Kafka ack, so a holder may read the record first:
    a GONE stream is released only once it lasts. A replica whose workers have not linked claims
    nothing; once they have, it claims the orphan, even one lost before its first event (it is
    continued from the start: no client saw anything)."""
    acceptor, accepted = await _replica(redis, prefix, "acceptor")
    taker_lease, taker_log = await _replica(redis, prefix, "taker")
    finished: list[RecordRef] = []
    holder = _holder(redis, taker_log, prefix, finished, gone_after_s=30.0)
    resumer = _Resumer(ready=False)
    holder.bind(resumer)
    ref = RecordRef(Priority.STANDARD, TopicPartition("t", 0), 0)
    try:
        holder.hold(_request("chatcmpl-late"), ref)
        await holder.check()
        assert finished == [] and holder.held == 1  # not filed yet: held on
        envelope = Envelope(id="chatcmpl-late", created=1, model="demo", service_tier="default", endpoint="chat",
                            include_usage=True)
        assert await accepted.create("chatcmpl-late", "t", "key-late", envelope=envelope) is None
        assert (await accepted.create("chatcmpl-other", "t", "key-late")).response_id == "chatcmpl-late"  # one key
        assert (await accepted.by_key("t", "key-late")).response_id == "chatcmpl-late"
        await acceptor.stop()  # lost before its first event
        await holder.check()
        await asyncio.sleep(0.1)
        assert resumer.resumed == [] and holder.held == 1  # no worker for its model yet: not claimed
        resumer.ready = True
        await holder.check()
        for _ in range(100):
            if resumer.resumed:
                break
            await asyncio.sleep(0.02)
        [(rid, claimed)] = resumer.resumed
        assert (rid, claimed.token_ids, claimed.next_seq, claimed.envelope) == ("chatcmpl-late", [], 0, envelope)
        assert claimed.key is not None
    finally:
        await holder.stop()
        await accepted.stop()
        await taker_log.stop()
        await taker_lease.stop()


async def test_a_pumped_streams_marks_let_a_taker_rebuild_its_state(redis: Redis, prefix: str) -> None:
    """A real pump over the Redis log, its deltas fed by hand as the dispatcher folds and delivers
    them: what a taker reads back is the state, typed (no SSE text parsed). The usage rows stand in
    for the database."""
    _, stream_log = await _replica(redis, prefix, "acceptor")
    flights: RequestTable[Flight] = RequestTable()
    service = SimpleNamespace(flights=flights, spawn=asyncio.ensure_future, usage=MemoryUsage(),
                              request_timeout_s=600.0)
    hub = StreamHub(stream_log, flights, asyncio.ensure_future)
    envelope = Envelope(id="chatcmpl-p", created=1, model="demo", service_tier="default", endpoint="chat",
                        include_usage=True)
    state = RequestState(request=_request("chatcmpl-p"), envelope=envelope, tenant_name="t", stream=True)
    submission = QueuedSubmission("chatcmpl-p", lambda rid: None)
    flight = Flight(cast(GenerationService, service), state, cast(TenantContext, SimpleNamespace(id="t")), submission)
    flights.add("chatcmpl-p", flight)
    holder = _holder(redis, stream_log, prefix, [])
    try:
        await stream_log.create("chatcmpl-p", "t", None, envelope=envelope)
        hub.start(flight, Framer(state, cast(ModelTokenizer, None)), grace_s=30)
        for delta in (RequestDelta(request_id="chatcmpl-p", token_ids=(5, 6), text="ab", num_output_tokens=2),
                      RequestDelta(request_id="chatcmpl-p", token_ids=(7,), text="", num_output_tokens=3),
                      RequestDelta(request_id="chatcmpl-p", token_ids=(8,), text="cd", num_output_tokens=4)):
            state.take_output(delta)
            submission.deliver(delta)
        await stream_log.flushed()
        claimed = await holder.read("chatcmpl-p", 1)
        # Four events: the opening, "ab", token 7's half character (an event with empty text), "cd".
        assert (claimed.envelope, claimed.token_ids, claimed.chars, claimed.next_seq) == (envelope, [5, 6, 7, 8], 4, 4)
        assert (claimed.finish, claimed.usage_sent, claimed.final) == (None, False, False)
        final = RequestDelta(request_id="chatcmpl-p", finish_reason=FinishReason.STOP, num_output_tokens=4)
        state.take_output(final)
        submission.deliver(final)
        pump = hub.pump("chatcmpl-p")
        assert pump is not None and pump.task is not None
        await asyncio.wait_for(pump.task, 10)
        await stream_log.flushed()
        claimed = await holder.read("chatcmpl-p", 1)
        assert (claimed.finish, claimed.usage_sent, claimed.final, claimed.ended) == ("stop", True, True, True)
    finally:
        await holder.stop()
        await stream_log.stop()
