"""Kafka for the gateway: class topics, the durable request log and its consumers.

Every accepted request is written to `{prefix}.requests.{class}` (msgspec msgpack, keyed by
tenant, acks=all) before the client hears "accepted". The gateway's own consumers read those
topics back into the in-memory fair scheduler; an offset is committed only once the request is
finished, tracked per partition by `PartitionWatermark` (commit the lowest unfinished offset), so
a restarted gateway replays exactly the unfinished requests (and maybe a few finished ones whose
commit had not gone out yet: callers de-duplicate by request id).

One consumer (and consumer group) per class: a flood in the batch topic is paused on its own
consumer and never delays fetching the interactive topic. Only the plain Kafka protocol is used
so the embedded Tansu broker and Apache Kafka behave the same (see KAFKA-NOTES.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from sluice.protocol import GenerateRequest, Priority
from sluice.settings import KafkaSettings

log = logging.getLogger(__name__)

COMMIT_RETRY_MAX_S = 5.0  # a failing commit is retried at most this far apart
STOP_TIMEOUT_S = 5.0  # stopping a Kafka client (a last commit, leaving the group) takes at most this

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GenerateRequest)


async def stop_client(client: AIOKafkaConsumer | AIOKafkaProducer) -> None:
    """Stops an aiokafka client within `STOP_TIMEOUT_S`, whatever state the broker is in.

    After a broker outage aiokafka's consumer `stop()` can raise the CancelledError of its own
    coordinator task: that is not this task being cancelled, so it is logged, not propagated
    (propagating it aborts the gateway's shutdown)."""
    try:
        await asyncio.wait_for(client.stop(), STOP_TIMEOUT_S)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
        log.warning("stopping the Kafka %s was cut short", type(client).__name__)
    except Exception as exc:
        log.warning("stopping the Kafka %s failed (%r)", type(client).__name__, exc)


class QueueUnavailable(Exception):
    """The broker did not take the request in time; the message says what happened."""


def topic_name(settings: KafkaSettings, priority: Priority) -> str:
    return f"{settings.topic_prefix}.requests.{priority.label}"


def encode_request(request: GenerateRequest) -> bytes:
    return _encoder.encode(request)


def decode_request(data: bytes) -> GenerateRequest:
    return _decoder.decode(data)


async def ensure_topics(settings: KafkaSettings, timeout_s: float = 10.0) -> list[str]:
    """Create the class topics that are missing (their names are returned). Existing topics are
    left as they are.

    Missing topics are found by listing, not by catching TopicAlreadyExists: Tansu answers
    success for an existing topic.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers,
                                request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        existing = set(await asyncio.wait_for(admin.list_topics(), timeout_s))
        wanted = [topic_name(settings, p) for p in Priority]
        missing = [
            NewTopic(name, num_partitions=settings.partitions,
                     replication_factor=settings.replication_factor,
                     topic_configs={"retention.ms": str(settings.retention_ms)})
            for name in wanted if name not in existing
        ]
        if missing:
            await asyncio.wait_for(admin.create_topics(missing), timeout_s)
            log.info("created topics %s", ", ".join(t.name for t in missing))
        return [t.name for t in missing]
    except (TimeoutError, KafkaError, OSError) as exc:
        raise QueueUnavailable(
            f"cannot reach the Kafka broker at {settings.bootstrap_servers} to create topics ({exc!r})"
        ) from exc
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


class RequestLog:
    """The producer side: `append()` returns once the broker acknowledged the request (acks=all)."""

    def __init__(self, settings: KafkaSettings, produce_timeout_s: float = 5.0,
                 on_recreated: Callable[[], None] | None = None) -> None:
        self._settings = settings
        self._timeout = produce_timeout_s
        self._on_recreated = on_recreated  # told when a lost topic was created again before a write
        self._producer: AIOKafkaProducer | None = None
        self._checked: set[str] = set()  # topics seen on the broker over `_checked_over`
        self._checked_over: frozenset[object] = frozenset()
        self._checking = asyncio.Lock()

    async def start(self) -> None:
        s = self._settings
        self._producer = AIOKafkaProducer(
            bootstrap_servers=s.bootstrap_servers,
            acks="all",
            enable_idempotence=s.enable_idempotence,
            max_request_size=s.max_request_bytes,
            request_timeout_ms=int(self._timeout * 1000),
            linger_ms=0,
        )
        try:
            await asyncio.wait_for(self._producer.start(), self._timeout * 2)
        except (TimeoutError, KafkaError, OSError) as exc:
            with contextlib.suppress(Exception):
                await self._producer.stop()
            self._producer = None
            raise QueueUnavailable(
                f"cannot connect to the Kafka broker at {s.bootstrap_servers} ({exc!r})") from exc

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await stop_client(producer)

    async def ping(self, timeout_s: float = 1.0) -> bool:
        """Whether the broker answers a metadata request now (for readiness)."""
        if self._producer is None:
            return False
        try:
            await asyncio.wait_for(self._producer.client.fetch_all_metadata(), timeout_s)
        except (TimeoutError, KafkaError, OSError):
            return False
        return True

    async def append(self, request: GenerateRequest) -> None:
        if self._producer is None:
            raise QueueUnavailable("the request queue is not started")
        topic = topic_name(self._settings, request.priority)
        try:
            # Bounded: with the broker gone, aiokafka would otherwise retry for a long time.
            await asyncio.wait_for(self._topic_exists(topic), self._timeout)
            await asyncio.wait_for(
                self._producer.send_and_wait(topic, encode_request(request),
                                             key=request.tenant_id.encode()),
                self._timeout,
            )
        except TimeoutError:
            raise QueueUnavailable(
                f"the request queue (Kafka at {self._settings.bootstrap_servers}) did not acknowledge "
                f"within {self._timeout:g}s; try again later"
            ) from None
        except KafkaError as exc:
            raise QueueUnavailable(
                f"the request queue rejected the request ({exc!r}); try again later") from exc

    def _connections(self) -> frozenset[object]:
        """The producer's open broker connections (aiokafka 0.14 keeps them in `client._conns`):
        a new one means the producer reconnected, and the broker may have restarted since."""
        assert self._producer is not None  # append() checked; internal invariant
        conns = getattr(self._producer.client, "_conns", {})
        return frozenset(conn for conn in conns.values() if conn.connected())

    async def _topic_exists(self, topic: str) -> None:
        """Never produce into a topic the broker does not have: Tansu (memory storage) restarted
        acknowledges a record sent to a topic it lost, and keeps nothing of it. The topic is looked
        up once per connection (after a reconnect, again) and the class topics are created if it
        is missing, before the record is sent."""
        if topic in self._checked and self._connections() == self._checked_over:
            return
        async with self._checking:
            assert self._producer is not None  # append() checked; internal invariant
            if self._connections() != self._checked_over:
                self._checked = set()
            if topic in self._checked:
                return
            metadata = await self._producer.client.fetch_all_metadata()
            if topic not in metadata.topics():
                log.warning("topic %s is missing on the broker (restarted?); creating the class topics", topic)
                if await ensure_topics(self._settings, self._timeout) and self._on_recreated is not None:
                    self._on_recreated()
            self._checked_over = self._connections()
            self._checked.add(topic)


class PartitionWatermark:
    """Offsets of one partition: commit the lowest unfinished offset (all below it are finished)."""

    def __init__(self) -> None:
        self._unfinished: set[int] = set()
        self._heap: list[int] = []  # min-heap of unfinished offsets, lazily cleaned
        self._next = 0  # one past the highest offset seen
        self.committable: int | None = None  # the commit position (None = nothing seen yet)

    def track(self, offset: int) -> None:
        if offset in self._unfinished:
            return
        if self.committable is None:  # the first offset seen is where the group already stands
            self.committable = offset
        self._unfinished.add(offset)
        heapq.heappush(self._heap, offset)
        self._next = max(self._next, offset + 1)

    def finish(self, offset: int) -> int | None:
        """Marks `offset` finished; returns the new commit offset if it advanced."""
        self._unfinished.discard(offset)
        while self._heap and self._heap[0] not in self._unfinished:
            heapq.heappop(self._heap)
        low = self._heap[0] if self._heap else self._next
        if self.committable is None or low > self.committable:
            self.committable = low
            return low
        return None

    @property
    def num_unfinished(self) -> int:
        return len(self._unfinished)


@dataclass(frozen=True, slots=True)
class RecordRef:
    """Where a consumed request sits in Kafka; handed back to `ClassConsumer.finish`.

    `epoch` counts how often the partition was found to have lost its records (a broker restarted
    with memory storage): a ref from an older epoch names an offset of a log that no longer
    exists, and finishing it changes nothing.
    """

    priority: Priority
    partition: TopicPartition
    offset: int
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class QueueCheck:
    """What `ClassConsumer.check` found."""

    lost: bool  # records were lost (partitions changed, or the log restarted below our position)
    caught_up: bool  # every record in the topic has been handed to `on_request`


OnRequest = Callable[[GenerateRequest, RecordRef], Awaitable[None]]


class ClassConsumer:
    """Reads one class topic into `on_request`; commits finished offsets; pausable."""

    def __init__(self, settings: KafkaSettings, priority: Priority, on_request: OnRequest,
                 *, commit_interval_s: float = 0.05, max_records: int = 500) -> None:
        self.priority = priority
        self._settings = settings
        self._on_request = on_request
        self._commit_interval = commit_interval_s
        self._max_records = max_records  # per fetch: how far a fetch can overshoot a pause
        self._consumer: AIOKafkaConsumer | None = None
        self._marks: dict[TopicPartition, PartitionWatermark] = {}
        self._epochs: dict[TopicPartition, int] = {}
        self._to_commit: dict[TopicPartition, int] = {}
        self._handling = False  # records of a fetch are being handed to on_request
        self._commit_failure = ""  # the condition last logged, so a failing commit logs once
        self._commit_wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._paused = False
        self._log_recreated = False  # set by `topic_recreated`, handled by the next `check`

    def topic_recreated(self) -> None:
        """The topic was created anew (the broker had lost it): the next `check` reads it again
        from the beginning, even where the new log already reaches past our old position (records
        written since the loss sit at offsets we had passed in the old log)."""
        self._log_recreated = True

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_unfinished(self) -> int:
        return sum(m.num_unfinished for m in self._marks.values())

    async def start(self) -> None:
        s = self._settings
        topic = topic_name(s, self.priority)
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=s.bootstrap_servers,
            group_id=f"{s.consumer_group}.{self.priority.label}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=s.max_request_bytes,
            fetch_max_bytes=max(s.max_request_bytes, 50 * 2**20),
            fetch_max_wait_ms=s.fetch_max_wait_ms,
        )
        await self._consumer.start()
        # Manual assignment of every partition, with the group used only for committed offsets:
        # one gateway owns the queue, and this avoids the group join (seconds on Tansu, more
        # after a restart while the dead member's session lingers). Several gateway replicas
        # would subscribe with a rebalance listener instead.
        partitions = self._consumer.partitions_for_topic(topic)
        for _ in range(50):
            if partitions:
                break
            await self._consumer._client.force_metadata_update()
            partitions = self._consumer.partitions_for_topic(topic)
            if not partitions:
                await asyncio.sleep(0.1)
        if not partitions:
            await self._consumer.stop()
            raise QueueUnavailable(f"topic {topic} has no partitions; was it created?")
        self._consumer.assign([TopicPartition(topic, p) for p in sorted(partitions)])
        self._paused = False
        self._tasks = [asyncio.create_task(self._fetch_loop(), name=f"consume-{self.priority.label}"),
                       asyncio.create_task(self._commit_loop(), name=f"commit-{self.priority.label}")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await self._flush_commits(consumer)
            await stop_client(consumer)

    def pause(self) -> None:
        if self._consumer is not None and not self._paused:
            self._consumer.pause(*self._consumer.assignment())
            self._paused = True

    def resume(self) -> None:
        if self._consumer is not None and self._paused:
            self._consumer.resume(*self._consumer.assignment())
            self._paused = False

    def finish(self, ref: RecordRef) -> None:
        """The request at `ref` is finished: its offset may be committed (once all below are)."""
        mark = self._marks.get(ref.partition)
        if mark is None or ref.epoch != self._epochs.get(ref.partition, 0):
            return
        new = mark.finish(ref.offset)
        if new is not None:
            self._to_commit[ref.partition] = new
            self._commit_wakeup.set()

    async def check(self) -> QueueCheck:
        """Compares what this consumer holds with what the broker has, and repairs a lost queue.

        - The topic's partitions changed (a recreated topic): every partition is assigned again.
        - The topic was recreated (`topic_recreated`): every partition is read from the beginning.
        - A partition's log ends below our position (Kafka answers OffsetOutOfRange there; Tansu
          with memory storage, restarted, silently returns nothing): its records are gone. Reading
          restarts at its beginning (records written since the loss), and its unfinished offsets
          are forgotten (their requests still finish; see `RecordRef.epoch`).
        Callers re-create what was lost from their source of truth (the database, for batches).
        """
        consumer = self._consumer
        if consumer is None:
            return QueueCheck(lost=False, caught_up=False)
        topic = topic_name(self._settings, self.priority)
        lost = False
        await consumer._client.force_metadata_update()
        partitions = consumer.partitions_for_topic(topic) or set()
        assigned = consumer.assignment()
        if partitions and {tp.partition for tp in assigned} != partitions:
            log.warning("topic %s now has partitions %s (had %s): the topic was recreated; assigning "
                        "them again", topic, sorted(partitions), sorted(tp.partition for tp in assigned))
            paused = self._paused
            consumer.assign([TopicPartition(topic, p) for p in sorted(partitions)])
            for tp in consumer.assignment():
                self._forget(tp)
            self._paused = False
            if paused:
                self.pause()
            lost = True
            assigned = consumer.assignment()
        recreated, self._log_recreated = self._log_recreated, False
        ends = await consumer.end_offsets(list(assigned))
        caught_up = not self._paused and not self._handling
        for tp in assigned:
            position = await consumer.position(tp)
            end = ends.get(tp, 0)
            if recreated:
                log.warning("topic %s was recreated: reading partition %s from the start", topic, tp)
                await consumer.seek_to_beginning(tp)
                self._forget(tp)
                lost, caught_up = True, False
            elif position > end:
                log.warning("partition %s ends at offset %d, below our position %d: its records were "
                            "lost (a broker restart with memory storage?); reading it from the start",
                            tp, end, position)
                await consumer.seek_to_beginning(tp)
                self._forget(tp)
                lost = True
                caught_up = False
            elif position < end:
                caught_up = False
        return QueueCheck(lost=lost, caught_up=caught_up and not self._handling)

    def _forget(self, tp: TopicPartition) -> None:
        """A partition whose log was lost: its offsets start over in a new epoch."""
        self._epochs[tp] = self._epochs.get(tp, 0) + 1
        self._marks.pop(tp, None)
        self._to_commit.pop(tp, None)

    async def _fetch_loop(self) -> None:
        consumer = self._consumer
        assert consumer is not None  # started; internal invariant
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=200, max_records=self._max_records)
            except KafkaError as exc:
                log.warning("fetching %s failed (%r); retrying", self.priority.label, exc)
                await asyncio.sleep(0.5)
                continue
            if self._paused:
                # A fetch already in flight when we paused: keep its records, they are cheap.
                for tp in batches:
                    consumer.pause(tp)
            self._handling = True
            try:
                await self._handle(batches)
            finally:
                self._handling = False

    async def _handle(self, batches: dict[TopicPartition, list[Any]]) -> None:
        for tp, records in batches.items():
            epoch = self._epochs.get(tp, 0)
            mark = self._marks.setdefault(tp, PartitionWatermark())
            for record in records:
                mark.track(record.offset)
                ref = RecordRef(self.priority, tp, record.offset, epoch)
                try:
                    request = decode_request(record.value)
                except msgspec.DecodeError as exc:
                    log.error("skipping an undecodable record at %s:%d (%s)", tp, record.offset, exc)
                    self.finish(ref)
                    continue
                try:
                    await self._on_request(request, ref)
                except Exception:
                    # One record must never stop consumption: `on_request` deals with what it
                    # can (see KafkaBackend); anything that still escapes skips this record.
                    log.exception("handling the record at %s:%d (%s) failed; skipping it",
                                  tp, record.offset, request.request_id)
                    self.finish(ref)

    async def _commit_loop(self) -> None:
        consumer = self._consumer
        assert consumer is not None  # started; internal invariant
        delay = self._commit_interval
        while True:
            await self._commit_wakeup.wait()
            self._commit_wakeup.clear()
            try:
                await self._flush_commits(consumer)
            except KafkaError as exc:
                # Backed off, and logged once per condition (not per attempt): a broker that lost
                # the topic answers every commit with the same error until the topic is back.
                condition = type(exc).__name__
                if condition != self._commit_failure:
                    self._commit_failure = condition
                    log.warning("committing %s offsets failed (%r); retrying, backed off",
                                self.priority.label, exc)
                delay = min(delay * 2, COMMIT_RETRY_MAX_S)
            else:
                if self._commit_failure:
                    log.info("committing %s offsets works again", self.priority.label)
                    self._commit_failure = ""
                delay = self._commit_interval
            await asyncio.sleep(delay)  # coalesce bursts of finishes; back off while failing

    async def _flush_commits(self, consumer: AIOKafkaConsumer) -> None:
        offsets, self._to_commit = self._to_commit, {}
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except Exception:
            for tp, off in offsets.items():  # keep them for the next attempt
                self._to_commit[tp] = max(off, self._to_commit.get(tp, off))
            self._commit_wakeup.set()
            raise
