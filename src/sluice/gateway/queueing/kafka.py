"""Kafka for the gateway: class topics, the durable request log and its consumers.

Every accepted request is written to `{prefix}.requests.{class}` (msgspec msgpack, keyed by
tenant, acks=all) before the client hears "accepted". The gateway's own consumers read those
topics back into the in-memory fair scheduler; an offset is committed only once the request is
finished, tracked per partition by `PartitionWatermark` (commit the lowest unfinished offset), so
a restarted gateway replays exactly the unfinished requests (and maybe a few finished ones whose
commit had not gone out yet: callers de-duplicate by request id).

One consumer (and consumer group) per class: a flood in the batch topic is paused on its own
consumer and never delays fetching the interactive topic. Only the plain Kafka protocol and
aiokafka's public API are used, so the embedded Tansu broker and Apache Kafka behave the same
(see KAFKA-NOTES.md).

Partitions are owned one of two ways (`ClassConsumer(group_assigned=...)`):
- one gateway process assigns itself every partition by hand and uses the group only for its
  committed offsets: it starts reading in ~0.1 s, where a group join takes about half the session
  timeout on Tansu, and twice the session timeout after a restart while the dead member's session
  lingers (measured, Tansu 0.6: session 6 s -> join 3 s, re-join 11 s; 1.5 s -> 1 s, 4 s);
- gateway replicas subscribe, and the consumer group splits the partitions between them. A
  rebalance revokes a partition from its owner, which commits its watermark and forgets it: refs
  of a revoked partition finish to nothing (`RecordRef.epoch`), so the old owner never commits
  an offset of a partition it lost, even once it gets it back; the new owner reads from the
  committed offset, i.e. replays exactly the unfinished records (and maybe a few finished ones
  above an unfinished one: callers de-duplicate by request id).
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
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import IllegalStateError, KafkaError
from aiokafka.partitioner import DefaultPartitioner

from sluice.protocol import GenerateRequest, Priority
from sluice.settings import KafkaSettings

log = logging.getLogger(__name__)

COMMIT_RETRY_MAX_S = 5.0  # a failing commit is retried at most this far apart
STOP_TIMEOUT_S = 5.0  # stopping a Kafka client (a last commit, leaving the group) takes at most this
START_WAIT_S = 5.0  # how long a consumer waits for its topic's partitions to show in the metadata
ACCEPTOR_HEADER = "sluice-acceptor"  # the replica that accepted (and wrote) a request
# The fetch wait of the topics whose records are all dispatched when accepted (`dispatched_at_acceptance`).
DISPATCHED_FETCH_WAIT_MS = 250

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


def dispatched_at_acceptance(priority: Priority) -> bool:
    """Whether every record of this class's topic is a stream or whole response, dispatched by the
    replica that accepted it (batch lines are all of the batch class): its consumer only finishes
    or holds them (gateway/streams/holder.py), so they need not be fetched soon after their write."""
    return priority is not Priority.BATCH


def fetch_wait_ms(settings: KafkaSettings, priority: Priority) -> int:
    """How long a fetch of this class's topic may wait at the broker. Tansu parks every fetch for
    the whole wait, so each consumer fetches about 1000/wait times a second, loaded or idle, and
    each fetch costs the broker and the gateway CPU on the gateway's core; `kafka.fetch_max_wait_ms`
    bounds the admission of batch lines, which only the batch topic holds."""
    if dispatched_at_acceptance(priority):
        return max(settings.fetch_max_wait_ms, DISPATCHED_FETCH_WAIT_MS)
    return settings.fetch_max_wait_ms


def group_base(settings: KafkaSettings) -> str:
    """The gateways' consumer group (each class topic's group adds `.<class>`): the configured
    `consumer_group`, else `<topic_prefix>-gateway`, so deployments with their own topics on one
    Kafka cluster never share a group (a rebalance waits for every member of its group)."""
    return settings.consumer_group or f"{settings.topic_prefix}-gateway"


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
                 on_recreated: Callable[[], None] | None = None, *, acceptor: str = "") -> None:
        self._settings = settings
        self._timeout = produce_timeout_s
        self._on_recreated = on_recreated  # told when a lost topic was created again before a write
        # Written into each record's ACCEPTOR_HEADER: whoever consumes a streaming record can tell
        # one its own process dispatched at acceptance from another replica's.
        self._headers = [(ACCEPTOR_HEADER, acceptor.encode())] if acceptor else None
        self._producer: AIOKafkaProducer | None = None
        self._present: frozenset[str] = frozenset()  # the broker's topics at the last lookup
        # The producer's live broker connections when that lookup ended (see `_topic_exists`).
        self._looked_up_on: tuple[object, ...] | None = None
        self._checking = asyncio.Lock()
        self.lookups = 0  # topic lookups made (appends that found the connections unchanged make none)

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
        producer = self._producer
        topic = topic_name(self._settings, request.priority)
        # Yield once first: a stream's job was handed to the dispatcher just before this append
        # (KafkaBackend.submit), so its worker or upstream gets the request before the producer
        # spends its CPU on this one; the client hears nothing until the ack either way.
        await asyncio.sleep(0)
        value, key = encode_request(request), request.tenant_id.encode()
        headers = self._headers
        if request.traceparent is not None:  # W3C trace context for tools that read Kafka headers
            headers = [*(headers or ()), ("traceparent", request.traceparent.encode())]
        try:
            # Bounded: with the broker gone, aiokafka would otherwise retry for a long time. A
            # timeout scope, not wait_for: wait_for runs each call in a task of its own, two
            # tasks and loop hops per request (Python 3.11).
            async with asyncio.timeout(self._timeout):
                await self._topic_exists(topic)
            before = self._live_connections()
            async with asyncio.timeout(self._timeout):
                await producer.send_and_wait(topic, value, key=key, headers=headers)
            # The producer reconnected while writing (aiokafka retries a broken send on a new
            # connection, silently): the broker that acknowledged may be a restarted one that lost
            # the topic and kept nothing. Look again; write again into a recreated topic.
            if before is not None and self._live_connections() != before:
                async with asyncio.timeout(self._timeout):
                    recreated = await self._topic_exists(topic)
                if recreated:
                    async with asyncio.timeout(self._timeout):
                        await producer.send_and_wait(topic, value, key=key, headers=headers)
        except TimeoutError:
            raise QueueUnavailable(
                f"the request queue (Kafka at {self._settings.bootstrap_servers}) did not acknowledge "
                f"within {self._timeout:g}s; try again later"
            ) from None
        except KafkaError as exc:
            raise QueueUnavailable(
                f"the request queue rejected the request ({exc!r}); try again later") from exc

    def _live_connections(self) -> tuple[object, ...] | None:
        """The producer's open broker connections, in order (None: this aiokafka does not show them).

        A TCP connection does not survive its broker's restart: while every connection open at the
        last topic lookup is still open, and no new one was made, the producer talks to the same
        broker processes that lookup saw. aiokafka offers no public signal of a reconnect (0.14:
        `AIOKafkaClient` has `ready(node_id)`, which opens a connection and does not tell whether it
        is a new one, and nothing that lists them), so this, the one place that does, reads its
        client's private connection table; without one every append looks the topics up."""
        assert self._producer is not None  # append() checked; internal invariant
        conns = getattr(self._producer.client, "_conns", None)
        if not isinstance(conns, dict):
            return None
        return tuple(conn for conn in conns.values() if conn.connected())

    async def _topic_exists(self, topic: str) -> bool:
        """Never produce into a topic the broker does not have: Tansu (memory storage) restarted
        acknowledges a record sent to a topic it lost, and keeps nothing of it. So the broker's
        topics are looked up (one metadata request) whenever the producer's connections changed
        since the last lookup (a broker may have restarted: `_live_connections`), and the class
        topics are created when this one is missing; True when it was. With the connections
        unchanged an append costs no lookup (one was ~0.5 ms against Tansu, about what the produce
        itself takes, and 10 % of the gateway's CPU per streamed request). Appends that wait while
        a lookup is in flight share it. Listing all topics, not describing ours: a metadata request
        naming a missing topic makes Tansu create it (with its default partition count)."""
        known = self._looked_up_on
        if topic in self._present and known is not None and self._live_connections() == known:
            return False
        async with self._checking:
            current = self._live_connections()
            if topic in self._present and current is not None and current == self._looked_up_on:
                return False  # looked up meanwhile, by an append that waited with this one
            assert self._producer is not None  # append() checked; internal invariant
            self.lookups += 1
            present = set((await self._producer.client.fetch_all_metadata()).topics())
            missing = topic not in present
            if missing:
                log.warning("topic %s is missing on the broker (restarted?); creating the class topics", topic)
                created = await ensure_topics(self._settings, self._timeout)
                present |= {topic_name(self._settings, p) for p in Priority}
                if created and self._on_recreated is not None:
                    self._on_recreated()
            self._present = frozenset(present)
            self._looked_up_on = self._live_connections()
            return missing


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

    `epoch` counts how often this consumer let go of the partition: it was revoked by a rebalance
    (another replica owns it now, or owned it meanwhile) or its records were lost (a broker
    restarted with memory storage). A ref from an older epoch names an offset this consumer no
    longer answers for, and finishing it changes nothing.
    `acceptor`: the replica that accepted the request (its record's header; "" when unknown).
    """

    priority: Priority
    partition: TopicPartition
    offset: int
    epoch: int = 0
    acceptor: str = ""


@dataclass(frozen=True, slots=True)
class QueueCheck:
    """What `ClassConsumer.check` found."""

    lost: bool  # records were lost (partitions changed, or the log restarted below our position)
    caught_up: bool  # every record in the topic has been handed to `on_request`


OnRequest = Callable[[GenerateRequest, RecordRef], Awaitable[None]]


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    """Hands the consumer group's revocations and assignments to their `ClassConsumer`."""

    def __init__(self, owner: ClassConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._owner._revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._owner._assigned(assigned)


class ClassConsumer:
    """Reads one class topic into `on_request`; commits finished offsets; pausable.

    `group_assigned`: False, one gateway process, which assigns itself every partition; True,
    gateway replicas, which share the partitions through the consumer group (module docstring)."""

    def __init__(self, settings: KafkaSettings, priority: Priority, on_request: OnRequest,
                 *, commit_interval_s: float = 0.05, max_records: int = 500,
                 group_assigned: bool = False) -> None:
        if not 0 < settings.heartbeat_interval_ms < settings.session_timeout_ms:
            raise ValueError(
                "kafka.heartbeat_interval_ms must be positive and below kafka.session_timeout_ms "
                f"(a third of it is usual), got {settings.heartbeat_interval_ms} and "
                f"{settings.session_timeout_ms}")
        self.priority = priority
        self.group_assigned = group_assigned
        self._settings = settings
        self._topic = topic_name(settings, priority)
        self._on_request = on_request
        self._commit_interval = commit_interval_s
        self._max_records = max_records  # per fetch: how far a fetch can overshoot a pause
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None  # reads the topic's partitions
        self._partitions: tuple[int, ...] = ()  # the topic's partitions, as last looked up
        self._owned: set[TopicPartition] = set()  # the partitions this consumer reads now
        self._joined = not group_assigned  # the group has given this member its assignment
        self.assignments = 0  # how often the owned partitions changed (a rebalance, a reassignment)
        self.records_read = 0  # records handed to `on_request` so far
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

    @property
    def owned(self) -> frozenset[TopicPartition]:
        return frozenset(self._owned)

    def owns_key(self, key: bytes) -> bool:
        """Whether records with this key land in a partition this consumer reads now: the
        producer's own partitioner over the topic's partitions (False before they are known)."""
        if not self._partitions:
            return False
        partitions = list(self._partitions)
        partition = DefaultPartitioner()(key, partitions, partitions)
        return TopicPartition(self._topic, partition) in self._owned

    def current(self, ref: RecordRef) -> bool:
        """Whether this consumer still answers for `ref` (not revoked or lost since it was read)."""
        return ref.partition in self._owned and ref.epoch == self._epochs.get(ref.partition, 0)

    async def start(self) -> None:
        s = self._settings
        self._admin = AIOKafkaAdminClient(bootstrap_servers=s.bootstrap_servers,
                                          request_timeout_ms=int(START_WAIT_S * 1000))
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=s.bootstrap_servers,
            group_id=f"{group_base(s)}.{self.priority.label}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=s.max_request_bytes,
            fetch_max_bytes=max(s.max_request_bytes, 50 * 2**20),
            fetch_max_wait_ms=fetch_wait_ms(s, self.priority),
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms,
        )
        try:
            await self._admin.start()
            await self._consumer.start()
            for _ in range(int(START_WAIT_S / 0.1)):
                self._partitions = await self._topic_partitions()
                if self._partitions:
                    break
                await asyncio.sleep(0.1)
            if not self._partitions:
                raise QueueUnavailable(f"topic {self._topic} has no partitions; was it created?")
        except BaseException:
            await self._close_clients()
            raise
        if self.group_assigned:
            self._consumer.subscribe([self._topic], listener=_Rebalance(self))
        else:
            self._assign_all()
        self._paused = False
        self._tasks = [asyncio.create_task(self._fetch_loop(), name=f"consume-{self.priority.label}"),
                       asyncio.create_task(self._commit_loop(), name=f"commit-{self.priority.label}")]

    async def _topic_partitions(self) -> tuple[int, ...]:
        """The topic's partitions on the broker now (none when it is missing). Every topic is
        described, not ours by name: naming a missing topic makes Tansu create it."""
        assert self._admin is not None  # started; internal invariant
        for topic in await self._admin.describe_topics():
            if topic["topic"] == self._topic and not topic["error_code"]:
                return tuple(sorted(p["partition"] for p in topic["partitions"]))
        return ()

    def _assign_all(self) -> None:
        """One gateway process: every partition, assigned by hand (forgetting what was held)."""
        assert self._consumer is not None  # started; internal invariant
        tps = [TopicPartition(self._topic, p) for p in self._partitions]
        self._consumer.assign(tps)
        for tp in tps:
            self._forget(tp)
        self._owned = set(tps)
        self.assignments += 1

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._flush_commits(self._consumer)
        await self._close_clients()

    async def _close_clients(self) -> None:
        consumer, self._consumer = self._consumer, None
        admin, self._admin = self._admin, None
        if consumer is not None:
            await stop_client(consumer)
        if admin is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(admin.close(), STOP_TIMEOUT_S)

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
        if mark is None or not self.current(ref):
            return
        new = mark.finish(ref.offset)
        if new is not None:
            self._to_commit[ref.partition] = new
            self._commit_wakeup.set()

    # ---- the consumer group's rebalances ---------------------------------------------------------

    async def _revoked(self, revoked: set[TopicPartition]) -> None:
        """Before the group reassigns `revoked`: commit their watermarks while this member still
        owns them, then forget them; their refs finish to nothing from now on."""
        self._joined = False
        consumer = self._consumer
        offsets = {tp: off for tp, off in self._to_commit.items() if tp in revoked}
        if offsets and consumer is not None:
            try:
                await consumer.commit(offsets)
            except KafkaError as exc:  # the group moved on already: the new owner replays more
                log.info("committing revoked %s partitions failed (%r)", self.priority.label, exc)
        for tp in revoked:
            self._forget(tp)
            self._owned.discard(tp)
        if revoked:
            self.assignments += 1
        log.info("%s partitions revoked: %s", self.priority.label, sorted(tp.partition for tp in revoked))

    def _assigned(self, assigned: set[TopicPartition]) -> None:
        """The group gave this member `assigned`: read from their committed offsets (a partition
        starts in its current epoch, so refs of an earlier time it was owned stay dead)."""
        self._owned = set(assigned)
        self._joined = True
        self.assignments += 1
        if self._paused and assigned and self._consumer is not None:
            self._consumer.pause(*assigned)
        log.info("%s partitions assigned: %s", self.priority.label, sorted(tp.partition for tp in assigned))

    # ---- keeping the queue whole -------------------------------------------------------------------

    async def check(self) -> QueueCheck:
        """Compares what this consumer holds with what the broker has, and repairs a lost queue.

        - The topic's partitions changed (a recreated topic): with manual assignment every
          partition is assigned again (a group rebalances on its own when its metadata shows it).
        - The topic was recreated (`topic_recreated`): every owned partition is read from the start.
        - A partition's log ends below our position (Kafka answers OffsetOutOfRange there; Tansu
          with memory storage, restarted, silently returns nothing): its records are gone. Reading
          restarts at its beginning (records written since the loss), and its unfinished offsets
          are forgotten (their requests still finish; see `RecordRef.epoch`).
        `caught_up` covers the partitions this consumer owns, and is False while a group
        rebalance is under way. Callers re-create what was lost from their source of truth (the
        database, for batches).
        """
        consumer = self._consumer
        if consumer is None:
            return QueueCheck(lost=False, caught_up=False)
        lost = False
        partitions = await self._topic_partitions()
        if partitions and partitions != self._partitions:
            log.warning("topic %s now has partitions %s (had %s): the topic was recreated", self._topic,
                        list(partitions), list(self._partitions))
            self._partitions = partitions
            if not self.group_assigned:
                paused = self._paused
                self._assign_all()
                self._paused = False
                if paused:
                    self.pause()
            lost = True
        recreated, self._log_recreated = self._log_recreated, False
        assigned = set(self._owned)
        try:
            ends = await consumer.end_offsets(list(assigned)) if assigned else {}
            caught_up = self._joined and not self._paused and not self._handling
            for tp in assigned:
                position = await consumer.position(tp)
                end = ends.get(tp, 0)
                if recreated:
                    log.warning("topic %s was recreated: reading partition %s from the start", self._topic, tp)
                    await consumer.seek_to_beginning(tp)
                    self._forget(tp)
                    lost, caught_up = True, False
                elif position > end and position > (consumer.highwater(tp) or 0):
                    # Both ends are asked: Tansu 0.6 answers ListOffsets with base + 1 of the last
                    # record batch written (6 records sent at once: end 1) until the next write,
                    # while its fetch responses carry the true high watermark (measured).
                    log.warning("partition %s ends at offset %d, below our position %d: its records were "
                                "lost (a broker restart with memory storage?); reading it from the start",
                                tp, end, position)
                    await consumer.seek_to_beginning(tp)
                    self._forget(tp)
                    lost = True
                    caught_up = False
                elif position < end:
                    caught_up = False
        except IllegalStateError:  # a rebalance took a partition away meanwhile: ask again later
            if recreated:
                self._log_recreated = True
            return QueueCheck(lost=lost, caught_up=False)
        return QueueCheck(lost=lost, caught_up=caught_up and not self._handling and assigned == self._owned)

    def _forget(self, tp: TopicPartition) -> None:
        """A partition revoked, or whose log was lost: its offsets start over in a new epoch."""
        self._epochs[tp] = self._epochs.get(tp, 0) + 1
        self._marks.pop(tp, None)
        self._to_commit.pop(tp, None)

    # ---- reading and committing ------------------------------------------------------------------

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
                    if tp in consumer.assignment():
                        consumer.pause(tp)
            self._handling = True
            try:
                await self._handle(batches)
            finally:
                self._handling = False

    async def _handle(self, batches: dict[TopicPartition, list[Any]]) -> None:
        for tp, records in batches.items():
            if tp not in self._owned:
                continue
            epoch = self._epochs.get(tp, 0)
            mark = self._marks.setdefault(tp, PartitionWatermark())
            for record in records:
                if self._epochs.get(tp, 0) != epoch:
                    break  # revoked (or its log lost) meanwhile: its owner reads the rest
                mark.track(record.offset)
                self.records_read += 1
                acceptor = next((v.decode(errors="replace") for k, v in record.headers or ()
                                 if k == ACCEPTOR_HEADER), "")
                ref = RecordRef(self.priority, tp, record.offset, epoch, acceptor)
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
        """Commits the pending watermarks of owned partitions. A failed commit keeps them for the
        next attempt, unless their partition was revoked or lost meanwhile (its epoch moved on)."""
        offsets = {tp: off for tp, off in self._to_commit.items() if tp in self._owned}
        self._to_commit = {}
        if not offsets:
            return
        epochs = {tp: self._epochs.get(tp, 0) for tp in offsets}
        try:
            await consumer.commit(offsets)
        except Exception:
            for tp, off in offsets.items():
                if self._epochs.get(tp, 0) == epochs[tp]:
                    self._to_commit[tp] = max(off, self._to_commit.get(tp, off))
            self._commit_wakeup.set()
            raise
