"""The embedded broker speaks enough Kafka for sluice: produce, consume, group commit, restart."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from sluice.broker import EmbeddedBroker, port_in_use
from sluice.errors import CLIError

pytestmark = pytest.mark.integration


async def _create_topic(bootstrap: str, topic: str, partitions: int = 2) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()


def _consumer(bootstrap: str, group: str) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                            auto_offset_reset="earliest")


async def _read(consumer: AIOKafkaConsumer, tp: TopicPartition, count: int) -> list[bytes]:
    """The next `count` records' values of `tp` (the consumer is assigned to it)."""
    seen: list[bytes] = []
    while len(seen) < count:
        records = await consumer.getmany(tp, timeout_ms=2000, max_records=count - len(seen))
        seen.extend(r.value for r in records.get(tp, []))
    return seen


async def test_produce_consume_and_group_commit(bootstrap_servers: str) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    group = f"g-{uuid.uuid4().hex[:8]}"
    await _create_topic(bootstrap_servers, topic, partitions=1)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, acks="all", enable_idempotence=False)
    await producer.start()
    try:
        for i in range(5):
            await producer.send_and_wait(topic, f"m{i}".encode(), key=b"tenant-a", headers=[("h", b"1")])
    finally:
        await producer.stop()

    tp = TopicPartition(topic, 0)
    consumer = _consumer(bootstrap_servers, group)
    await consumer.start()
    try:
        consumer.assign([tp])
        assert await _read(consumer, tp, 3) == [b"m0", b"m1", b"m2"]
        await consumer.commit({tp: 3})  # the next offset to read
        assert await consumer.committed(tp) == 3
    finally:
        await consumer.stop()

    # A new consumer of the same group resumes at the committed offset.
    consumer = _consumer(bootstrap_servers, group)
    await consumer.start()
    try:
        consumer.assign([tp])
        assert await _read(consumer, tp, 2) == [b"m3", b"m4"]
    finally:
        await consumer.stop()


def test_broker_restart_gives_a_working_broker(tmp_path) -> None:
    broker = EmbeddedBroker(log_path=tmp_path / "b.log").start()
    port = broker.port
    broker.stop()
    assert not broker.running
    assert not port_in_use("127.0.0.1", port)
    broker = EmbeddedBroker(port=port, log_path=tmp_path / "b.log").start()
    try:
        async def roundtrip() -> bytes:
            topic = f"r-{uuid.uuid4().hex[:8]}"
            await _create_topic(broker.bootstrap_servers, topic, partitions=1)
            producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers, acks="all")
            await producer.start()
            try:
                await producer.send_and_wait(topic, b"after-restart")
            finally:
                await producer.stop()
            consumer = AIOKafkaConsumer(topic, bootstrap_servers=broker.bootstrap_servers,
                                        auto_offset_reset="earliest")
            await consumer.start()
            try:
                return (await asyncio.wait_for(consumer.getone(), 10)).value
            finally:
                await consumer.stop()

        assert asyncio.run(roundtrip()) == b"after-restart"
    finally:
        broker.stop()


def test_port_in_use_is_a_clear_error(broker: EmbeddedBroker) -> None:
    with pytest.raises(CLIError, match="already in use"):
        EmbeddedBroker(port=broker.port).start()


def test_unknown_storage_is_a_clear_error() -> None:
    with pytest.raises(CLIError, match="unknown broker storage"):
        EmbeddedBroker(storage="floppy://x").start()


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("SLUICE_BROKER_BIN", str(tmp_path / "no-such-tansu"))
    with pytest.raises(CLIError, match="not an executable file"):
        EmbeddedBroker().start()
