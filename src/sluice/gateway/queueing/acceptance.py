"""`KafkaBackend`: the production GenerationBackend (durable queue, fair scheduler, remote workers).

submit(): the request's stream is registered (`_streams`) and its job handed to the dispatcher,
then the request is written to its class topic (acks=all, the accepting replica in its header);
only once the broker acknowledged it is it "accepted": submit() returns and the HTTP handler may
send the response head and the first token. The job runs meanwhile (durability overlaps with
work: the client's time to first token is max(ack, first token) instead of their sum); its
deltas wait in the submission, unread. An append that fails (or a client gone before the ack)
aborts the job at its worker or upstream, and the client gets the 503 it got before: it never
heard "accepted", so nothing it was promised is lost by a crash before the ack. The accepting
process always dispatches a streaming request itself: it is only ever served to the client
waiting on this process, so its record is there for durability of the acceptance, not to be
run from. Whichever replica's consumer reads a streaming record (under the consumer group another
replica may own its partition) does not run it: without shared state it just finishes its offset
(it was dispatched by its acceptor, or its acceptor died and its client went with it); with
shared state it holds the record until the stream's log has ended, and takes the generation over
when its replica dies (`StreamHolder`, gateway/streams/holder.py; `resume`). Streams held in memory
are therefore bounded by the quotas' per-tenant `max_queued` (admission refuses beyond it), not by
`max_backlog_per_class`; held records do not count toward a class's backlog, the streams themselves
count toward their class's backlog all the same, so a full class pauses its consumer.

Batch lines are run from Kafka: each replica runs the lines of the partitions the consumer group
gave it (all of them for a lone gateway), through the `BatchLineHandler` (de-duplication by
(batch_id, custom_id), quota admission); a line's result is persisted before its offset may be
committed (see `gateway/queueing/kafka.py`). A partition revoked by a rebalance goes to another replica,
which replays its unfinished lines; lines of it still queued or running here are let finish (the
unique result row keeps results and billing exactly-once; the duplicate costs compute, bounded by
the class backlog), and a deferred one is dropped (its new owner has it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiokafka.errors import KafkaError

from sluice import telemetry
from sluice.gateway.cluster.shared import SharedState, open_shared
from sluice.gateway.dispatch.dispatcher import DeltaSink, Dispatcher, Job
from sluice.gateway.queueing.backend import BackendUnavailable, QueuedSubmission, ServedModel, Submission
from sluice.gateway.queueing.kafka import ClassConsumer, QueueUnavailable, RecordRef, RequestLog, ensure_topics
from sluice.gateway.streams.holder import StreamHolder
from sluice.gateway.streams.log import RedisStreamLog
from sluice.protocol import (
    FinishReason,
    GenerateRequest,
    Priority,
    RequestDelta,
    ServedModelInfo,
    tokenizer_identity,
)
from sluice.settings import Settings

log = logging.getLogger(__name__)

# Storing a batch line's result is retried while the database fails, backed off up to this.
PERSIST_RETRY_FIRST_S = 0.25
PERSIST_RETRY_MAX_S = 5.0
PREPARE_RETRY_S = 1.0  # a batch line whose preparation failed is asked about again after this
QUEUE_CHECK_S = 2.0  # how often the queue is compared with the broker (lost topics and records)
LOST_LINES_CHECK_S = 10.0  # how often, besides after a loss, batch lines are audited against the database


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
    """What the Batch API runner provides for lines of a batch (see gateway/batches/runner.py)."""

    async def prepare(self, request: GenerateRequest) -> bool | Defer:
        """Before dispatch: True = run it; False = skip (result already stored, or batch no longer
        runnable); Defer = over a rate limit, ask again later (a line waits, it is not failed)."""
        ...

    def collector(self, request: GenerateRequest) -> DeltaSink:
        """Accumulates the line's deltas."""
        ...

    async def persist(self, request: GenerateRequest, final: RequestDelta) -> None:
        """Stores the line's result (idempotent on (batch_id, custom_id)); then its offset is committed."""
        ...

    async def lost_lines(self, settled: Settled) -> list[GenerateRequest]:
        """The lines of runnable batches in partitions `settled()` (awaited after the database was
        read) says are read here, that the database has no result for and that it does not name as
        held: the queue lost them."""
        ...


class StreamSubmission(QueuedSubmission):
    """A client's stream: deltas delivered by the dispatcher, read by the HTTP handler."""

    def __init__(self, request_id: str, backend: KafkaBackend) -> None:
        super().__init__(request_id, backend._abort)
        self.job: Job | None = None  # set once dispatched (at acceptance)

    @property
    def worker(self) -> str:
        """The worker serving it ("" before dispatch): for the gateway's request records."""
        return self.job.worker if self.job is not None else ""

    @property
    def dispatch_time(self) -> float | None:
        """When it was sent to its worker (unix s): records split TTFT into gateway and engine parts."""
        return self.job.dispatch_time if self.job is not None else None


def _model_max_len(path: str, engine_options: dict[str, Any]) -> int:
    from sluice.workers.model.config import ModelConfig

    limit = ModelConfig.from_dir(Path(path)).max_position_embeddings
    configured = engine_options.get("max_model_len")
    return min(limit, int(configured)) if configured else limit


class KafkaBackend:
    """Durable enqueue to Kafka, fair scheduling in memory, dispatch to registered workers."""

    def __init__(self, settings: Settings, *, batch_handler: BatchLineHandler | None = None,
                 worker_port: int | None = None, shared: SharedState | None = None) -> None:
        if not settings.kafka.bootstrap_servers:
            raise ValueError(
                "KafkaBackend needs settings.kafka.bootstrap_servers (or start the embedded broker)")
        if settings.scheduler.max_backlog_per_class < 1:
            raise ValueError("scheduler.max_backlog_per_class must be at least 1, got "
                             f"{settings.scheduler.max_backlog_per_class}")
        self.settings = settings
        # The state replicas share; started here only when this backend opened it itself (a
        # caller that passes one, e.g. to share it with the app, starts and stops it).
        self._owns_shared = shared is None
        self.shared = open_shared(settings.shared) if shared is None else shared
        self.batch_handler = batch_handler
        self._worker_port = worker_port
        self._log = RequestLog(settings.kafka, settings.kafka.produce_timeout_s, on_recreated=self._topics_recreated,
                               acceptor=self.shared.replica)
        self.dispatcher = Dispatcher(settings, self._on_finished, shared=self.shared)
        self._consumers: dict[Priority, ClassConsumer] = {}
        self._streams: dict[str, StreamSubmission] = {}  # accepted by this process, not yet finished
        # A held batch line's newest record, when a second one arrived while it was held (the
        # partition came back after a rebalance, or the audit re-enqueued it): finished with it.
        self._rebound: dict[str, RecordRef] = {}
        self._prepare_failing: set[str] = set()  # batch lines whose preparation failed (logged once)
        # Batch lines held here outside the dispatcher (see `_held_lines`).
        self._routing: set[str] = set()
        self._deferred_ids: set[str] = set()
        self._persisting: set[str] = set()
        self._queue_lost = False  # a loss was seen and its lines are not re-enqueued yet
        self.requeued_lines = 0  # batch lines re-enqueued from the database after a queue loss
        self._backlog: dict[Priority, int] = dict.fromkeys(Priority, 0)
        self._models: list[ServedModel] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self.replayed_orphans = 0  # records of requests accepted by another replica, not run here
        # With shared state: the records of streamed requests, held until their logs end.
        self.holder: StreamHolder | None = None
        stream_log = self.shared.stream_log
        if settings.shared.url and self.shared.clients and isinstance(stream_log, RedisStreamLog):
            self.holder = StreamHolder(self.shared.clients[0], stream_log, prefix=settings.shared.prefix,
                                       replica=self.shared.replica, finish=self._finish_ref,
                                       current=self._current_ref)
        self.deferred = 0  # batch lines waiting out a rate limit now
        self.deferrals_total = 0

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._models = [ServedModel(name=m.name, path=m.path,
                                    max_model_len=_model_max_len(m.path, self.settings.engine))
                        for m in self.settings.models]
        self.dispatcher.expected_models = {
            m.name: ServedModelInfo(name=m.name, max_model_len=m.max_model_len, tokenizer=tokenizer_identity(m.path))
            for m in self._models}
        if self._owns_shared:
            await self.shared.start()
        try:
            await ensure_topics(self.settings.kafka)
            await self._log.start()
        except QueueUnavailable as exc:
            raise BackendUnavailable(str(exc)) from exc
        await self.dispatcher.start(port=self._worker_port)
        for priority in Priority:
            # Small fetches keep the in-memory backlog near its bound when the consumer pauses.
            max_records = max(1, min(500, self.settings.scheduler.max_backlog_per_class // 4))
            # Replicas (a shared store) split the partitions through the consumer group; a lone
            # gateway assigns itself all of them and skips the join (gateway/queueing/kafka.py).
            consumer = ClassConsumer(self.settings.kafka, priority, self._on_request, max_records=max_records,
                                     group_assigned=bool(self.settings.shared.url))
            await consumer.start()
            self._consumers[priority] = consumer
        self._started = True
        self._spawn(self._keep_queue())
        if self.holder is not None:
            await self.holder.start()

    async def stop_consuming(self) -> None:
        """Leaves the consumer group now (each consumer commits its finished offsets, then leaves):
        a draining replica's batch partitions move to the others at once, while the requests it
        accepted run on here. What it still held is replayed by the new owners (exactly once by
        the result rows, see the module docstring)."""
        consumers = list(self._consumers.values())
        self._consumers.clear()
        await asyncio.gather(*(consumer.stop() for consumer in consumers))

    @property
    def open_requests(self) -> int:
        """Requests accepted here (streamed or not) and not finished: what a drain waits for."""
        return len(self._streams)

    async def stop(self) -> None:
        if self.holder is not None:
            await self.holder.stop()
        await self.stop_consuming()
        for task in list(self._tasks):
            task.cancel()
        await self.dispatcher.stop()
        await self._log.stop()
        if self._owns_shared:
            await self.shared.stop()
        self._started = False

    @property
    def worker_port(self) -> int:
        return self.dispatcher.port

    def served_models(self) -> list[ServedModel]:
        return list(self._models)

    def could_serve(self, model: str) -> bool:
        return self.dispatcher.could_serve(model)

    async def ready(self) -> dict[str, bool]:
        return {"broker": self._started and await self._log.ping(),
                "workers": bool(self.dispatcher.workers)}

    # ---- accepting -----------------------------------------------------------------------------

    async def submit(self, request: GenerateRequest) -> Submission:
        # Registered before the write: our consumer may read the record before append() returns.
        # Dispatched at once, while the broker is still writing it (module docstring): the
        # client hears nothing (this returns nothing) until the append is acknowledged, so the
        # stream's time to first token is max(ack, first token), not their sum.
        stream = self._open_stream(request)
        try:
            await self._log.append(request)
        except QueueUnavailable as exc:
            self._abort(request.request_id)  # not accepted: its job ends at its worker too
            raise BackendUnavailable(str(exc)) from exc
        except BaseException:  # cancelled (the client went away): never accepted either
            self._abort(request.request_id)
            raise
        return stream

    def resume(self, request: GenerateRequest) -> StreamSubmission:
        """Continues a stream another replica accepted and lost (gateway/streams/holder.py): dispatched
        with its `resume_token_ids`, ahead of its tenant's newer work; its held record is
        already in Kafka (nothing is written)."""
        stream = self._open_stream(request)
        if stream.job is not None:
            stream.job.resume_after(request.resume_token_ids)
        return stream

    def _open_stream(self, request: GenerateRequest) -> StreamSubmission:
        """Registers a request accepted here (or taken over) and hands it to the dispatcher."""
        if not self._started:
            raise BackendUnavailable("the gateway is starting or stopping; try again shortly")
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        stream = StreamSubmission(request.request_id, self)
        self._streams[request.request_id] = stream
        try:
            self._enqueue(request, stream.deliver, ref=None)
        except BaseException:
            self._streams.pop(request.request_id, None)
            raise
        return stream

    async def enqueue_batch_line(self, request: GenerateRequest) -> None:
        """Durably queue one batch line (the Batch API calls this before answering)."""
        try:
            await self._log.append(request)
        except QueueUnavailable as exc:
            raise BackendUnavailable(str(exc)) from exc

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and request_id in self.dispatcher:
            self.dispatcher.cancel(request_id)
        # Not consumed yet: with no stream registered, the consumer finishes it without generation.

    # ---- consuming -----------------------------------------------------------------------------

    async def _on_request(self, request: GenerateRequest, ref: RecordRef, *, claimed: bool = False) -> None:
        """One consumed record. Whatever goes wrong with it ends that request alone (with an error
        its client or batch sees), never the consumer. A second record of a batch line held here
        (being routed, deferred, queued or running, being stored) is a duplicate (Kafka delivers at
        least once; a rebalance gave its partition back; the audit may re-enqueue a line): nothing
        runs twice, and its offset is finished when the line is (`_rebound`).
        `claimed`: the caller (a deferred retry) already holds the request in `_routing`."""
        if request.batch_id is None:
            # Dispatched at acceptance by the replica that accepted it (or its client is gone).
            if ref.acceptor != self.shared.replica:
                self.replayed_orphans += 1
            if self.holder is not None:
                self.holder.hold(request, ref)  # until its log ends; taken over if its replica dies
            else:
                self._finish_ref(ref)
            return
        if not claimed and self._holds(request.request_id):
            self._rebind(request.request_id, ref)
            return
        self._routing.add(request.request_id)
        try:
            await self._route(request, ref)
        except Exception as exc:
            log.exception("could not handle request %s; ending it with an error", request.request_id)
            self._fail_record(request, ref, f"the gateway could not handle this request ({type(exc).__name__})")
        finally:
            self._routing.discard(request.request_id)

    def _holds(self, request_id: str) -> bool:
        return (request_id in self._routing or request_id in self._deferred_ids
                or request_id in self._persisting or request_id in self.dispatcher)

    def _rebind(self, request_id: str, ref: RecordRef) -> None:
        """A second record of a held line: it is finished together with the line, so the commit
        never passes a line still held here (were this replica to die, it is replayed)."""
        older = self._rebound.get(request_id)
        self._rebound[request_id] = ref
        if older is not None:
            self._finish_ref(older)

    def _fail_record(self, request: GenerateRequest, ref: RecordRef, message: str) -> None:
        final = RequestDelta(request_id=request.request_id, finish_reason=FinishReason.ERROR, error=message)
        if request.batch_id is not None and self.batch_handler is not None:
            # Its error result is stored like any finished line's, then the offset is committed.
            self._persisting.add(request.request_id)
            self._spawn(self._persist_then_commit(request, ref, final))
            return
        self._finish_line(request.request_id, ref)

    async def _route(self, request: GenerateRequest, ref: RecordRef) -> None:
        handler = self.batch_handler
        verdict = False if handler is None else await self._prepare(handler, request)
        if isinstance(verdict, Defer):
            # Later, without holding up the consumer: other tenants' lines keep flowing. It
            # counts toward the class's in-memory backlog meanwhile (a rate-limited flood pauses
            # the topic instead of piling up timers).
            asyncio.get_running_loop().call_later(verdict.seconds, self._retry_deferred, request, ref)
            self._deferred_ids.add(request.request_id)
            self.deferred += 1
            self.deferrals_total += 1
            self._adjust_backlog(request.priority, +1)
            return
        if not verdict:
            self._finish_line(request.request_id, ref)
            return
        assert handler is not None  # verdict True implies a handler; for the type checker
        self._enqueue(request, handler.collector(request), ref)

    async def _prepare(self, handler: BatchLineHandler, request: GenerateRequest) -> bool | Defer:
        """The handler's verdict; while it fails (the database is down) the line waits and asks
        again, it is neither run nor failed."""
        try:
            verdict = await handler.prepare(request)
        except Exception as exc:
            if request.request_id not in self._prepare_failing:
                self._prepare_failing.add(request.request_id)
                log.warning("preparing batch line %s failed (%r); it waits and is tried again",
                            request.request_id, exc)
            return Defer(PREPARE_RETRY_S)
        self._prepare_failing.discard(request.request_id)
        return verdict

    def _enqueue(self, request: GenerateRequest, sink: DeltaSink, ref: RecordRef | None) -> None:
        job = Job(request=request, sink=sink, ref=ref,
                  enqueued_at=min(time.time(), request.arrival_time or time.time()))
        self.dispatcher.enqueue(job)  # first: a request it refuses leaves no trace here
        if request.batch_id is None:
            self._streams[request.request_id].job = job
        self._adjust_backlog(request.priority, +1)

    def _adjust_backlog(self, priority: Priority, change: int) -> None:
        """Jobs held in memory per class; pause the class topic at the bound, resume at half."""
        self._backlog[priority] += change
        consumer = self._consumers.get(priority)
        if consumer is None:
            return
        limit = self.settings.scheduler.max_backlog_per_class
        if self._backlog[priority] >= limit:
            consumer.pause()
        elif consumer.paused and self._backlog[priority] < max(1, limit // 2):
            consumer.resume()

    def _retry_deferred(self, request: GenerateRequest, ref: RecordRef) -> None:
        self.deferred -= 1
        self._deferred_ids.discard(request.request_id)
        self._adjust_backlog(request.priority, -1)
        newer = self._rebound.pop(request.request_id, None)
        if newer is not None:  # read again meanwhile (its partition came back): that record counts
            self._finish_ref(ref)
            ref = newer
        consumer = self._consumers.get(ref.priority)
        if consumer is not None and not consumer.current(ref):
            return  # its partition was revoked: the new owner replays it (a deferred line holds no quota)
        if self._started:
            self._routing.add(request.request_id)  # held from now on, not only once the task runs
            self._spawn(self._on_request(request, ref, claimed=True))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _finish_ref(self, ref: RecordRef | None) -> None:
        if ref is None:  # dispatched on acceptance: the consumer finishes its record when it reads it
            return
        consumer = self._consumers.get(ref.priority)
        if consumer is not None:
            consumer.finish(ref)

    def _current_ref(self, ref: RecordRef) -> bool:
        consumer = self._consumers.get(ref.priority)
        return consumer is not None and consumer.current(ref)

    def _finish_line(self, request_id: str, ref: RecordRef | None) -> None:
        """A batch line is done here: its record's offset, and a second record's, may be committed."""
        self._finish_ref(ref)
        self._finish_ref(self._rebound.pop(request_id, None))

    def _on_finished(self, job: Job, final: RequestDelta) -> None:
        request = job.request
        self._adjust_backlog(request.priority, -1)
        if request.batch_id is None:
            self._streams.pop(request.request_id, None)
            return
        self._emit_record(job, final)
        self._persisting.add(request.request_id)
        self._spawn(self._persist_then_commit(request, job.ref, final))

    async def _persist_then_commit(self, request: GenerateRequest, ref: RecordRef | None,
                                   final: RequestDelta) -> None:
        """Stores a batch line's result, retrying (backed off, without limit) while the database
        fails; only a stored result lets its offset be committed. The handler keeps the line's
        output until it is stored, so every retry writes the real result, billed once."""
        assert self.batch_handler is not None  # batch jobs exist only with a handler
        delay = PERSIST_RETRY_FIRST_S
        failures = 0
        while True:
            try:
                await self.batch_handler.persist(request, final)
                break
            except Exception as exc:
                failures += 1
                if failures == 1:
                    log.warning("storing the result of %s failed (%r); retrying until it is stored",
                                request.request_id, exc, exc_info=True)
                await asyncio.sleep(delay)
                delay = min(delay * 2, PERSIST_RETRY_MAX_S)
        if failures:
            log.info("stored the result of %s after %d failed attempt(s)", request.request_id, failures)
        self._persisting.discard(request.request_id)
        self._finish_line(request.request_id, ref)

    # ---- queue loss ----------------------------------------------------------------------------

    async def _keep_queue(self) -> None:
        """Keeps the queue whole: recreates missing topics, lets each consumer repair a lost log
        (see `ClassConsumer.check`), and re-enqueues from the database the batch lines the queue
        lost. The database is the source of truth for batch work: a line is lost when its batch
        runs, it has no result, the batch topic has been read to its end and nothing here holds
        it. Problems reaching the broker are logged once per condition, and retried."""
        failure = ""
        since_audit = LOST_LINES_CHECK_S  # audit once at start: the broker may have restarted
        while True:
            try:
                if await ensure_topics(self.settings.kafka):
                    self._topics_recreated()
                for consumer in self._consumers.values():
                    if (await asyncio.wait_for(consumer.check(), QUEUE_CHECK_S * 5)).lost:
                        self._queue_lost = True
                if self._queue_lost or since_audit >= LOST_LINES_CHECK_S:
                    since_audit = 0.0
                    await asyncio.wait_for(self._requeue_lost_lines(), QUEUE_CHECK_S * 30)
            except (QueueUnavailable, KafkaError, OSError, TimeoutError) as exc:
                condition = type(exc).__name__
                if condition != failure:
                    failure = condition
                    log.warning("checking the queue failed (%r); retrying every %gs", exc, QUEUE_CHECK_S)
            except Exception:
                log.exception("checking the queue failed")
            else:
                if failure:
                    log.info("the queue is reachable again")
                    failure = ""
            await asyncio.sleep(QUEUE_CHECK_S)
            since_audit += QUEUE_CHECK_S

    def _topics_recreated(self) -> None:
        """Topics were missing and are created anew: the broker lost its queue. Every consumer reads
        its topic again from the start, and the lost-lines audit runs at the next check."""
        self._queue_lost = True
        for consumer in self._consumers.values():
            consumer.topic_recreated()

    def _held_lines(self) -> frozenset[str]:
        return frozenset(self._routing | self._deferred_ids | self._persisting
                         | {rid for rid in self.dispatcher.request_ids() if rid.startswith("batch_")})

    async def _requeue_lost_lines(self) -> None:
        """Audits the lines of the batch partitions this replica reads (another replica answers
        for the rest), once they are read to the end and unchanged since the database was read."""
        handler, consumer = self.batch_handler, self._consumers.get(Priority.BATCH)
        if handler is None or consumer is None:
            return
        read_to_end = False
        assignments = consumer.assignments

        def owns(tenant_id: str) -> bool:
            return consumer.owns_key(tenant_id.encode())  # the producer's key (RequestLog.append)

        async def settled() -> HeldLines | None:
            nonlocal read_to_end
            check = await consumer.check()
            read_to_end = check.caught_up and consumer.assignments == assignments
            self._queue_lost = self._queue_lost or check.lost
            return HeldLines(self._held_lines(), owns) if read_to_end and not check.lost else None

        lost = await handler.lost_lines(settled)
        if not read_to_end:
            return  # records still unread: ask again at the next check
        for request in lost:
            await self._log.append(request)
        if lost:
            self.requeued_lines += len(lost)
            log.warning("re-enqueued %d batch line(s) the queue had lost", len(lost))
        self._queue_lost = False

    def _emit_record(self, job: Job, final: RequestDelta) -> None:
        request = job.request
        label = getattr(self.batch_handler, "tenant_label", None)
        tenant = label(request.tenant_id) if callable(label) else request.tenant_id
        with contextlib.suppress(ValueError):  # clock skew between processes: skip the record
            telemetry.emit_record(telemetry.make_record(
                request_id=request.request_id, tenant=tenant, model=request.model,
                priority_class=request.priority.label, worker=job.worker, arrival=request.arrival_time,
                dispatch_time=job.dispatch_time, first_token_time=final.first_token_time,
                finish_time=time.time(), token_times=job.token_times,
                prompt_tokens=final.num_prompt_tokens or len(request.prompt_token_ids),
                completion_tokens=final.num_output_tokens, cached_tokens=final.num_cached_tokens,
                finish_reason=str(final.finish_reason or FinishReason.ERROR),
                engine_first_scheduled=final.first_scheduled_time, engine_first_token=final.first_token_time,
                batch_id=request.batch_id,
            ))

    # ---- views ---------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        from sluice.gateway.queueing.snapshot import backend_snapshot

        return backend_snapshot(self)
