"""The durable request log against the real embedded broker: produce, consume, commit, replay."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from sluice.gateway.queueing.consumer import ClassConsumer, RecordRef
from sluice.gateway.queueing.kafka import QueueUnavailable, RequestLog, ensure_topics
from sluice.protocol import GenerateRequest, Priority, SamplingParams
from sluice.settings import KafkaSettings

pytestmark = pytest.mark.integration


def request(n: int, priority: Priority = Priority.STANDARD) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{n}", tenant_id=f"t{n % 3}", model="demo", priority=priority,
                           prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=2),
                           cache_salt="s", arrival_time=0.0)


async def collect(settings: KafkaSettings, priority: Priority, want: int
                  ) -> tuple[ClassConsumer, list[tuple[GenerateRequest, RecordRef]]]:
    got: list[tuple[GenerateRequest, RecordRef]] = []
    done = asyncio.Event()

    async def on_request(req: GenerateRequest, ref: RecordRef) -> None:
        got.append((req, ref))
        if len(got) >= want:
            done.set()

    consumer = ClassConsumer(settings, priority, on_request)
    await consumer.start()
    await asyncio.wait_for(done.wait(), 30)
    return consumer, got


async def test_unfinished_requests_are_replayed_after_restart(bootstrap_servers: str) -> None:
    settings = KafkaSettings(bootstrap_servers=bootstrap_servers, topic_prefix=f"q{uuid.uuid4().hex[:8]}",
                             partitions=2)
    await ensure_topics(settings)
    await ensure_topics(settings)  # idempotent
    log = RequestLog(settings)
    await log.start()
    try:
        for n in range(10):
            await log.append(request(n))
    finally:
        await log.stop()

    consumer, got = await collect(settings, Priority.STANDARD, 10)
    assert sorted(r.request_id for r, _ in got) == [f"r{n}" for n in range(10)]
    finished = {r.request_id for r, _ in got if int(r.request_id[1:]) % 2 == 0}
    for req, ref in got:
        if req.request_id in finished:
            consumer.finish(ref)
    await consumer.stop()  # flushes the commits

    consumer, replayed = await collect(settings, Priority.STANDARD, 5)
    await asyncio.sleep(0.5)  # nothing more should arrive
    await consumer.stop()
    # Every unfinished request comes back; a finished one only if it sat above an unfinished
    # offset of its partition (its commit could not pass that one): callers de-duplicate.
    replayed_ids = {r.request_id for r, _ in replayed}
    unfinished = {r.request_id for r, _ in got} - finished
    assert unfinished <= replayed_ids
    low = {}
    for req, ref in got:
        if req.request_id in unfinished:
            low[ref.partition] = min(low.get(ref.partition, ref.offset), ref.offset)
    for req, ref in got:
        if req.request_id in replayed_ids - unfinished:
            assert ref.offset > low[ref.partition]
    assert len(replayed) == len(replayed_ids)


async def test_unreachable_broker_fails_fast() -> None:
    from sluice.broker import free_port

    settings = KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}")
    log = RequestLog(settings, produce_timeout_s=0.5)
    with pytest.raises(QueueUnavailable, match="cannot connect"):
        await log.start()
    with pytest.raises(QueueUnavailable, match="not started"):
        await log.append(request(0))


async def test_records_written_at_once_are_not_taken_for_lost(bootstrap_servers: str) -> None:
    """Tansu 0.6 answers ListOffsets with base + 1 of the last record batch until the next write:
    records appended concurrently (one batch) must not look like a log that ends below our
    position (which would read the partition again from the start at every check)."""
    settings = KafkaSettings(bootstrap_servers=bootstrap_servers, topic_prefix=f"q{uuid.uuid4().hex[:8]}",
                             partitions=1)
    await ensure_topics(settings)
    log = RequestLog(settings)
    await log.start()
    try:
        await asyncio.gather(*(log.append(request(n)) for n in range(6)))
    finally:
        await log.stop()
    consumer, got = await collect(settings, Priority.STANDARD, 6)
    try:
        for _, ref in got:
            consumer.finish(ref)
        check = await consumer.check()
        assert not check.lost and check.caught_up
        assert consumer.records_read == 6
    finally:
        await consumer.stop()
