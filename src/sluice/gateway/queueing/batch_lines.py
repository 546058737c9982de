"""Running batch lines from Kafka: each replica runs the lines of the batch partitions the consumer
group gave it (all of them for a lone gateway), through the `BatchLineHandler` (the Batch API's
runner, batches/runner.py: de-duplication by (batch_id, custom_id), quota admission, results).

A line's result is persisted before its offset may be committed (queueing/consumer.py). A second
record of a line held here (being routed, deferred, queued or running, being stored) is a
duplicate (Kafka delivers at least once; a rebalance gave its partition back; the audit may
re-enqueue a line): nothing runs twice, and its offset is finished when the line is. A partition
revoked by a rebalance goes to another replica, which replays its unfinished lines; lines of it
still queued or running here are let finish (the unique result row keeps results and billing
exactly-once; the duplicate costs compute, bounded by the class backlog), and a deferred one is
dropped (its new owner has it). The database is the source of truth for batch work: lines the
queue lost are written to it again by `requeue_lost` (the Kafka backend's queue keeper calls it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sluice import telemetry
from sluice.gateway.dispatch.jobs import DeltaSink, Job
from sluice.gateway.generation.state import RequestState
from sluice.gateway.queueing.consumer import RecordRef
from sluice.protocol import GenerateRequest, Priority

if TYPE_CHECKING:
    from sluice.gateway.queueing.acceptance import KafkaBackend

log = logging.getLogger(__name__)

# Storing a batch line's result is retried while the database fails, backed off up to this.
PERSIST_RETRY_FIRST_S = 0.25
PERSIST_RETRY_MAX_S = 5.0
PREPARE_RETRY_S = 1.0  # a batch line whose preparation failed is asked about again after this


@dataclass(frozen=True, slots=True)
class Defer:
    """A batch line that may not run yet (its tenant is over a rate limit): retry it after `seconds`.

    Its offset stays uncommitted meanwhile, so a restart still replays it.
    """

    seconds: float


@dataclass(frozen=True, slots=True)
class HeldLines:
    """What this replica answers for once its partitions of the batch queue are read to the end."""

    ids: frozenset[str]  # batch lines held here (being routed, deferred, queued or running, being stored)
    owns: Callable[[str], bool]  # whether a tenant's lines (keyed by tenant id) are in a partition read here


# None while records are still unread (or the group is rebalancing).
Settled = Callable[[], Awaitable[HeldLines | None]]


class BatchLineHandler(Protocol):
    """What the Batch API runner provides for lines of a batch (batches/runner.py)."""

    async def prepare(self, request: GenerateRequest) -> bool | Defer:
        """Before dispatch: True = run it; False = skip (result already stored, or batch no longer
        runnable); Defer = over a rate limit, ask again later (a line waits, it is not failed)."""
        ...

    def start(self, request: GenerateRequest) -> tuple[RequestState, DeltaSink]:
        """A line `prepare` let run: its state, and the sink that keeps its output."""
        ...

    def failed(self, request: GenerateRequest, error: str) -> RequestState:
        """A line whose handling raised: its state, ended with `error`."""
        ...

    async def persist(self, state: RequestState) -> None:
        """Stores the line's result (idempotent on (batch_id, custom_id)); then its offset is committed."""
        ...

    async def lost_lines(self, settled: Settled) -> list[GenerateRequest]:
        """The lines of runnable batches in partitions `settled()` (awaited after the database was
        read) says are read here, that the database has no result for and that it does not name as
        held: the queue lost them."""
        ...


class BatchLines:
    """The batch lines this replica holds, from their record to their stored result."""

    def __init__(self, backend: KafkaBackend, handler: BatchLineHandler) -> None:
        self.backend = backend
        self.handler = handler
        # A held line's newest record, when a second one arrived while it was held (the partition
        # came back after a rebalance, or the audit re-enqueued it): finished with it.
        self._rebound: dict[str, RecordRef] = {}
        self._prepare_failing: set[str] = set()  # lines whose preparation failed (logged once)
        # Held here outside the dispatcher (see `held`).
        self._routing: set[str] = set()
        self._deferred_ids: set[str] = set()
        self._persisting: set[str] = set()
        self.requeued_lines = 0  # lines re-enqueued from the database after a queue loss
        self.deferred = 0  # lines waiting out a rate limit now
        self.deferrals_total = 0

    async def on_record(self, request: GenerateRequest, ref: RecordRef, *, claimed: bool = False) -> None:
        """One consumed line. Whatever goes wrong with it ends that line alone (with an error result),
        never the consumer. `claimed`: the caller (a deferred retry) already holds it in `_routing`."""
        if not claimed and self._holds(request.request_id):
            self._rebind(request.request_id, ref)
            return
        self._routing.add(request.request_id)
        try:
            await self._route(request, ref)
        except Exception as exc:
            log.exception("could not handle request %s; ending it with an error", request.request_id)
            self._persist(self.handler.failed(request, f"the gateway could not handle this request "
                                                       f"({type(exc).__name__})"), ref)
        finally:
            self._routing.discard(request.request_id)

    def _holds(self, request_id: str) -> bool:
        return (request_id in self._routing or request_id in self._deferred_ids
                or request_id in self._persisting or request_id in self.backend.dispatcher)

    def held(self) -> frozenset[str]:
        return frozenset(self._routing | self._deferred_ids | self._persisting
                         | {rid for rid in self.backend.dispatcher.request_ids() if rid.startswith("batch_")})

    def _rebind(self, request_id: str, ref: RecordRef) -> None:
        """A second record of a held line: it is finished together with the line, so the commit
        never passes a line still held here (were this replica to die, it is replayed)."""
        older = self._rebound.get(request_id)
        self._rebound[request_id] = ref
        if older is not None:
            self.backend.finish_ref(older)

    async def _route(self, request: GenerateRequest, ref: RecordRef) -> None:
        verdict = await self._prepare(request)
        if isinstance(verdict, Defer):
            # Later, without holding up the consumer: other tenants' lines keep flowing. It
            # counts toward the class's in-memory backlog meanwhile (a rate-limited flood pauses
            # the topic instead of piling up timers).
            asyncio.get_running_loop().call_later(verdict.seconds, self._retry_deferred, request, ref)
            self._deferred_ids.add(request.request_id)
            self.deferred += 1
            self.deferrals_total += 1
            self.backend.adjust_backlog(request.priority, +1)
            return
        if not verdict:
            self._finish_line(request.request_id, ref)
            return
        state, sink = self.handler.start(request)
        now = time.time()
        self.backend.enqueue(Job(state=state, sink=sink, ref=ref, enqueued_at=min(now, request.arrival_time or now)))

    async def _prepare(self, request: GenerateRequest) -> bool | Defer:
        """The handler's verdict; while it fails (the database is down) the line waits and asks
        again, it is neither run nor failed."""
        try:
            verdict = await self.handler.prepare(request)
        except Exception as exc:
            if request.request_id not in self._prepare_failing:
                self._prepare_failing.add(request.request_id)
                log.warning("preparing batch line %s failed (%r); it waits and is tried again",
                            request.request_id, exc)
            return Defer(PREPARE_RETRY_S)
        self._prepare_failing.discard(request.request_id)
        return verdict

    def _retry_deferred(self, request: GenerateRequest, ref: RecordRef) -> None:
        self.deferred -= 1
        self._deferred_ids.discard(request.request_id)
        self.backend.adjust_backlog(request.priority, -1)
        newer = self._rebound.pop(request.request_id, None)
        if newer is not None:  # read again meanwhile (its partition came back): that record counts
            self.backend.finish_ref(ref)
            ref = newer
        if not self.backend.current_ref(ref):
            return  # its partition was revoked: the new owner replays it (a deferred line holds no quota)
        if self.backend.running:
            self._routing.add(request.request_id)  # held from now on, not only once the task runs
            self.backend.spawn(self.on_record(request, ref, claimed=True))

    def _finish_line(self, request_id: str, ref: RecordRef | None) -> None:
        """A line is done here: its record's offset, and a second record's, may be committed."""
        self.backend.finish_ref(ref)
        self.backend.finish_ref(self._rebound.pop(request_id, None))

    def on_finished(self, job: Job) -> None:
        """Its final delta came (the dispatcher's end of a batch job): record, then store and commit."""
        state = job.state
        with contextlib.suppress(ValueError):  # clock skew between processes: skip the record
            telemetry.emit_record(state.record(), state.token_times)
        self._persist(state, job.ref)

    def _persist(self, state: RequestState, ref: RecordRef | None) -> None:
        self._persisting.add(state.request_id)
        self.backend.spawn(self._persist_then_commit(state, ref))

    async def _persist_then_commit(self, state: RequestState, ref: RecordRef | None) -> None:
        """Stores a line's result, retrying (backed off, without limit) while the database fails;
        only a stored result lets its offset be committed. The handler keeps the line's output
        until it is stored, so every retry writes the real result, billed once."""
        delay = PERSIST_RETRY_FIRST_S
        failures = 0
        while True:
            try:
                await self.handler.persist(state)
                break
            except Exception as exc:
                failures += 1
                if failures == 1:
                    log.warning("storing the result of %s failed (%r); retrying until it is stored",
                                state.request_id, exc, exc_info=True)
                await asyncio.sleep(delay)
                delay = min(delay * 2, PERSIST_RETRY_MAX_S)
        if failures:
            log.info("stored the result of %s after %d failed attempt(s)", state.request_id, failures)
        self._persisting.discard(state.request_id)
        self._finish_line(state.request_id, ref)

    async def requeue_lost(self) -> bool:
        """Audits the lines of the batch partitions this replica reads (another replica answers
        for the rest), once they are read to the end and unchanged since the database was read.
        Returns False while records are still unread (ask again at the next check)."""
        consumer = self.backend.consumer(Priority.BATCH)
        if consumer is None:
            return True
        read_to_end = False
        assignments = consumer.assignments
        lost_seen = False

        def owns(tenant_id: str) -> bool:
            return consumer.owns_key(tenant_id.encode())  # the producer's key (RequestLog.append)

        async def settled() -> HeldLines | None:
            nonlocal read_to_end, lost_seen
            check = await consumer.check()
            read_to_end = check.caught_up and consumer.assignments == assignments
            lost_seen = lost_seen or check.lost
            return HeldLines(self.held(), owns) if read_to_end and not check.lost else None

        lost = await self.handler.lost_lines(settled)
        if lost_seen:
            self.backend.mark_queue_lost()
        if not read_to_end:
            return False
        for request in lost:
            await self.backend.append(request)
        if lost:
            self.requeued_lines += len(lost)
            log.warning("re-enqueued %d batch line(s) the queue had lost", len(lost))
        return True

