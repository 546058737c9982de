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

Batch lines are run from Kafka by `BatchLines` (queueing/batch_lines.py), from the records of
the batch partitions this replica's consumer reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError

from sluice import tracing
from sluice.gateway.cluster.shared import SharedState, open_shared
from sluice.gateway.dispatch.dispatcher import Dispatcher
from sluice.gateway.dispatch.jobs import Job
from sluice.gateway.generation.state import RequestState
from sluice.gateway.queueing.backend import BackendUnavailable, LinkLimits, QueuedSubmission, ServedModel
from sluice.gateway.queueing.batch_lines import BatchLineHandler, BatchLines
from sluice.gateway.queueing.consumer import ClassConsumer, RecordRef
from sluice.gateway.queueing.kafka import QueueUnavailable, RequestLog, ensure_topics
from sluice.gateway.streams.holder import StreamHolder
from sluice.gateway.streams.redis_log import RedisStreamLog
from sluice.protocol import GenerateRequest, Priority, RequestDelta, ServedModelInfo, tokenizer_identity
from sluice.settings import Settings

log = logging.getLogger(__name__)

QUEUE_CHECK_S = 2.0  # how often the queue is compared with the broker (lost topics and records)
LOST_LINES_CHECK_S = 10.0  # how often, besides after a loss, batch lines are audited against the database


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
        self._worker_port = worker_port
        self._log = RequestLog(settings.kafka, settings.kafka.produce_timeout_s, on_recreated=self.topics_recreated,
                               acceptor=self.shared.replica)
        self.dispatcher = Dispatcher(settings, self._on_finished, shared=self.shared)
        self.batch_lines = BatchLines(self, batch_handler) if batch_handler is not None else None
        self._consumers: dict[Priority, ClassConsumer] = {}
        self._queue_lost = False  # a loss was seen and its lines are not re-enqueued yet
        self._backlog: dict[Priority, int] = dict.fromkeys(Priority, 0)
        self._models: list[ServedModel] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.running = False
        self.replayed_orphans = 0  # records of requests accepted by another replica, not run here
        # With shared state: the records of streamed requests, held until their logs end.
        self.holder: StreamHolder | None = None
        stream_log = self.shared.stream_log
        if settings.shared.url and self.shared.clients and isinstance(stream_log, RedisStreamLog):
            self.holder = StreamHolder(self.shared.clients[0], stream_log, prefix=settings.shared.prefix,
                                       replica=self.shared.replica, finish=self.finish_ref,
                                       current=self.current_ref)

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.running:
            return
        self._models = [ServedModel(name=m.name, path=m.path,
                                    max_model_len=_model_max_len(m.path, self.settings.engine),
                                    tool_parser=m.tool_parser)
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
            # gateway assigns itself all of them and skips the join (queueing/consumer.py).
            consumer = ClassConsumer(self.settings.kafka, priority, self._on_record, max_records=max_records,
                                     group_assigned=bool(self.settings.shared.url))
            await consumer.start()
            self._consumers[priority] = consumer
        self.running = True
        self.spawn(self._keep_queue())
        if self.holder is not None:
            await self.holder.start()

    async def stop_consuming(self) -> None:
        """Leaves the consumer group now (each consumer commits its finished offsets, then leaves):
        a draining replica's batch partitions move to the others at once, while the requests it
        accepted run on here. What it still held is replayed by the new owners (exactly once by
        the result rows, see batch_lines.py)."""
        consumers = list(self._consumers.values())
        self._consumers.clear()
        await asyncio.gather(*(consumer.stop() for consumer in consumers))

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
        self.running = False

    @property
    def worker_port(self) -> int:
        return self.dispatcher.port

    def served_models(self) -> list[ServedModel]:
        return list(self._models)

    def could_serve(self, model: str) -> bool:
        return self.dispatcher.could_serve(model)

    def predicted_ttft(self, request: GenerateRequest) -> float | None:
        return self.dispatcher.predicted_ttft(request)

    def link_limits(self, model: str) -> LinkLimits:
        upstream = any(model in spec.models for spec in self.settings.upstreams)
        return LinkLimits(max_model_len=self.dispatcher.upstream_context(model), logprobs=not upstream)

    async def ready(self) -> dict[str, bool]:
        return {"broker": self.running and await self._log.ping(),
                "workers": bool(self.dispatcher.workers)}

    # ---- accepting -----------------------------------------------------------------------------

    async def submit(self, state: RequestState) -> QueuedSubmission:
        # Dispatched at once, while the broker is still writing the record (module docstring): the
        # client hears nothing (this returns nothing) until the append is acknowledged, so the
        # stream's time to first token is max(ack, first token), not their sum. Our consumer may
        # read the record before append() returns: it only holds or finishes it.
        submission = self._open_stream(state)
        try:
            with tracing.span("kafka.append", kind="producer"):
                await self._log.append(state.request)
        except QueueUnavailable as exc:
            self.dispatcher.cancel(state.request_id)  # not accepted: its job ends at its worker too
            raise BackendUnavailable(str(exc)) from exc
        except BaseException:  # cancelled (the client went away): never accepted either
            self.dispatcher.cancel(state.request_id)
            raise
        return submission

    def resume(self, state: RequestState) -> QueuedSubmission:
        """Continues a stream another replica accepted and lost (streams/holder.py): dispatched
        with its `resume_token_ids`, ahead of its tenant's newer work; its held record is already
        in Kafka (nothing is written)."""
        return self._open_stream(state)

    def _open_stream(self, state: RequestState) -> QueuedSubmission:
        """Hands a request accepted here (or taken over) to the dispatcher; its deltas go to the
        submission the caller reads."""
        if not self.running:
            raise BackendUnavailable("the gateway is starting or stopping; try again shortly")
        submission = QueuedSubmission(state.request_id, self.dispatcher.cancel)
        now = time.time()
        self.enqueue(Job(state=state, sink=submission.deliver, enqueued_at=min(now, state.request.arrival_time or now)))
        return submission

    async def enqueue_batch_line(self, request: GenerateRequest) -> None:
        """Durably queue one batch line (the Batch API calls this before answering)."""
        try:
            await self._log.append(request)
        except QueueUnavailable as exc:
            raise BackendUnavailable(str(exc)) from exc

    async def append(self, request: GenerateRequest) -> None:
        await self._log.append(request)

    def enqueue(self, job: Job) -> None:
        self.dispatcher.enqueue(job)  # first: a request it refuses leaves no trace here
        self.adjust_backlog(job.request.priority, +1)

    # ---- consuming -----------------------------------------------------------------------------

    async def _on_record(self, request: GenerateRequest, ref: RecordRef) -> None:
        """One consumed record. A stream or whole answer was dispatched at acceptance by the replica
        that accepted it (or its client is gone): it is held until its log ends (a takeover if its
        replica dies), or finished at once without shared state. A batch line is run."""
        if request.batch_id is None:
            if ref.acceptor != self.shared.replica:
                self.replayed_orphans += 1
            if self.holder is not None:
                self.holder.hold(request, ref)
            else:
                self.finish_ref(ref)
            return
        if self.batch_lines is None:
            self.finish_ref(ref)
            return
        await self.batch_lines.on_record(request, ref)

    def adjust_backlog(self, priority: Priority, change: int) -> None:
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

    def consumer(self, priority: Priority) -> ClassConsumer | None:
        return self._consumers.get(priority)

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def finish_ref(self, ref: RecordRef | None) -> None:
        if ref is None:  # dispatched on acceptance: the consumer finishes its record when it reads it
            return
        consumer = self._consumers.get(ref.priority)
        if consumer is not None:
            consumer.finish(ref)

    def current_ref(self, ref: RecordRef) -> bool:
        consumer = self._consumers.get(ref.priority)
        return consumer is not None and consumer.current(ref)

    def _on_finished(self, job: Job, final: RequestDelta) -> None:
        self.adjust_backlog(job.request.priority, -1)
        if job.request.batch_id is not None and self.batch_lines is not None:
            self.batch_lines.on_finished(job)

    # ---- queue loss ----------------------------------------------------------------------------

    async def _keep_queue(self) -> None:
        """Keeps the queue whole: recreates missing topics, lets each consumer repair a lost log
        (see `ClassConsumer.check`), and has the batch lines the queue lost re-enqueued from the
        database (batch_lines.py). Problems reaching the broker are logged once per condition, and
        retried."""
        failure = ""
        since_audit = LOST_LINES_CHECK_S  # audit once at start: the broker may have restarted
        while True:
            try:
                if await ensure_topics(self.settings.kafka):
                    self.topics_recreated()
                for consumer in self._consumers.values():
                    if (await asyncio.wait_for(consumer.check(), QUEUE_CHECK_S * 5)).lost:
                        self.mark_queue_lost()
                if self.batch_lines is not None and (self._queue_lost or since_audit >= LOST_LINES_CHECK_S):
                    since_audit = 0.0
                    if await asyncio.wait_for(self.batch_lines.requeue_lost(), QUEUE_CHECK_S * 30):
                        self._queue_lost = False
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

    def mark_queue_lost(self) -> None:
        """Records of the queue were lost: the lost-lines audit runs at the next check."""
        self._queue_lost = True

    def topics_recreated(self) -> None:
        """Topics were missing and are created anew: the broker lost its queue. Every consumer reads
        its topic again from the start, and the lost-lines audit runs at the next check."""
        self._queue_lost = True
        for consumer in self._consumers.values():
            consumer.topic_recreated()

    # ---- views ---------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        from sluice.gateway.queueing.snapshot import backend_snapshot

        return backend_snapshot(self)
