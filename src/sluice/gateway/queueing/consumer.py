"""The gateway's Kafka consumers: each class topic read back into the fair scheduler, offsets
committed by watermark once requests finish (the log itself is `queueing/kafka.py`).

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
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import IllegalStateError, KafkaError
from aiokafka.partitioner import DefaultPartitioner

from sluice.gateway.queueing.kafka import (
    ACCEPTOR_HEADER,
    STOP_TIMEOUT_S,
    QueueUnavailable,
    decode_request,
    fetch_wait_ms,
    group_base,
    stop_client,
    topic_name,
)
from sluice.protocol import GenerateRequest, Priority
from sluice.settings import KafkaSettings

log = logging.getLogger(__name__)

START_WAIT_S = 5.0  # how long a consumer waits for its topic's partitions to show in the metadata

COMMIT_RETRY_MAX_S = 5.0  # a failing commit is retried at most this far apart


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
