"""Dispatch: the worker registry, the dispatch loop, and deltas routed to each job's sink.

The jobs (`dispatch/jobs.py`) are owned here, from `enqueue` to their final delta; each delta
from a worker is folded into the request's one record (`RequestState.take_output`) before it goes
to the job's sink.

A worker is anything behind the `WorkerLink` interface (`gateway/dispatch/links/base.py`): a worker process
connected to the worker port (`gateway/dispatch/links/tcp.py`), an engine in this process
(`gateway/dispatch/links/inprocess.py`), or an OpenAI-compatible HTTP server configured under [[upstreams]]
(`gateway/dispatch/links/upstream.py`, docs/upstreams.md). The dispatcher treats them alike: same queue, room
rule, deltas, and loss; links report back through its `LinkHost` side (attach, deliver, report,
lose, lose_job, wake).

Engine hosts report `WorkerCapacity` on every change and as a heartbeat. Queued jobs wait in the
fair scheduler (`gateway/dispatch/fair.py`) until a worker has room; a worker's own waiting queue is kept at
most `max_worker_waiting` long so that priority and fairness are decided here, at the last moment.

The room rule: a worker's waiting estimate is `num_waiting + sent - num_received` (what it reported
plus what is on the wire). A job may go to a worker whose estimate is under the limit; a job of a
more urgent class than some job that has not started on that worker may go as well, as long as
fewer than `max_worker_waiting` jobs of its class or more urgent are unstarted there. That lets an
interactive request reach a worker saturated by batch work, where the engine's priority scheduler
preempts batch work for it, while batch work alone never piles up in a worker's queue.

Several replicas (docs/scale-out.md, "One global schedule"): each sends its own jobs to every
worker, so no replica alone knows a worker's unstarted jobs. With a shared store the rule is
applied by `gateway/dispatch/slots.py` to the counts of every replica, atomically, before a job is sent
(one awaited script per decision), and the fair scheduler's counters are the cluster's
(`gateway/dispatch/fair_shared.py`). In-process (the default) the decision is synchronous, as it always was.

Draining: `drain(worker_id)` stops sending new jobs to a worker; what it already holds runs to the
end (so it can be stopped or upgraded without failing a request). The mark is kept by worker id, so
a draining worker that reconnects stays drained until `undrain`.

Deltas from a worker go straight to the job's sink (a client stream or a batch collector); there
is no per-token round trip through Kafka. A worker that disconnects or misses heartbeats is
dropped (worker failover, docs/streams.md): each of its unfinished jobs, streams and batch lines
alike, goes back into line ahead of its tenant's newer work with `resume_token_ids` = the tokens
already delivered to its sink, so another engine recomputes prompt + those and goes on; the
client sees a stall, not an error. A job gets at most `MAX_DISPATCH_ATTEMPTS` workers (a request
that kills every worker it lands on fails instead of taking the fleet down one worker at a time).
A resumed job goes to links that resume (engines) only. Jobs an upstream held are not resumed (an
upstream cannot resume, and may send no token ids): its streams end with an error, its batch
lines are re-queued from scratch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec
from redis.exceptions import RedisError

from sluice import telemetry, tracing
from sluice.gateway.cluster.shared import SharedState
from sluice.gateway.dispatch.fair import ClassPolicy, FairScheduler, Pending
from sluice.gateway.dispatch.jobs import DeltaSink as DeltaSink
from sluice.gateway.dispatch.jobs import Job, ended_sink
from sluice.gateway.dispatch.links.base import EngineLink, WorkerLink
from sluice.gateway.dispatch.links.tcp import WorkerPort
from sluice.gateway.dispatch.links.upstream import UpstreamLink
from sluice.gateway.dispatch.routing import PromptBlocks, Router
from sluice.gateway.dispatch.slots import LocalSlots, RedisSlots, WorkerSlots, room_for
from sluice.gateway.dispatch.ttft import RoomPace
from sluice.protocol import (
    FinishReason,
    GenerateRequest,
    KvEvents,
    Priority,
    RequestDelta,
    ServedModelInfo,
    WorkerCapacity,
)
from sluice.settings import Settings

log = logging.getLogger(__name__)

_Target = TypeVar("_Target")
# A job whose worker died this many times fails instead of being re-queued again (a request that
# crashes workers must not crash them forever).
MAX_DISPATCH_ATTEMPTS = 3
# Shared slots: a round that another replica's jobs refused is tried again this soon (the
# fallback: their releases are announced and wake the loop at once, gateway/dispatch/slots.py).
SLOT_RETRY_S = 0.05
SLOT_ERROR_RETRY_S = 0.5  # Redis unreachable: jobs stay queued, tried again this often
# A round that held a job back for the worker holding its prefix (Router.in_reach) is tried again
# this soon at the latest (a release wakes it sooner), so the hold's time limit is kept.
HELD_RETRY_S = 0.1


OnFinished = Callable[[Job, RequestDelta], None]


class Dispatcher:
    """Owns the scheduler, the worker registry and the worker port."""

    def __init__(self, settings: Settings, on_finished: OnFinished, *, shared: SharedState | None = None) -> None:
        self.settings = settings
        sched = settings.scheduler
        self.fairness = shared.fairness if shared is not None else None  # cluster-wide counters, or none
        self.scheduler: FairScheduler[Job] = FairScheduler(ClassPolicy(
            priority_enabled=sched.priority_enabled,
            aging_s=sched.aging_s,
            min_share={Priority.STANDARD: sched.min_share_standard, Priority.BATCH: sched.min_share_batch},
        ), shared_counters=self.fairness is not None)
        if self.fairness is not None:
            self.fairness.bind(self.scheduler)
        # Who may send to a worker: this process alone, or every replica through the shared store.
        self.slots: WorkerSlots = shared.slots if shared is not None else LocalSlots()
        if isinstance(self.slots, RedisSlots):
            self.slots.on_release = lambda: self._wake.set()
        self._slot_error = False  # Redis unreachable at the last take (logged once per outage)
        self.workers: dict[str, WorkerLink] = {}
        # Where each job goes among the workers with room (dispatch/routing.py, docs/routing.md).
        self.router = Router(settings.routing)
        self.pace = RoomPace()  # how fast room appears for held jobs, per model (TTFT prediction)
        self.held = False  # the last local round held a job back for its prefix's worker (HELD_RETRY_S)
        # Prompt tokens each worker was sent and found in its prefix cache, by worker id (the
        # console's hit rate; kept across reconnects, like the metrics).
        self.prefill_totals: dict[str, list[int]] = {}
        # The [[upstreams]] links, attached to `workers` while their server answers (links/upstream.py).
        self.upstreams: list[UpstreamLink] = []
        self.draining: set[str] = set()  # worker ids that get no new jobs (see the module docstring)
        self._on_finished = on_finished
        self._jobs: dict[str, Job] = {}  # every job queued or on a worker, by request id
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Tokens streamed per worker and not yet counted in the metrics: counted when a job ends
        # and once per heartbeat interval, not per delta (a metric update takes a lock and a
        # window entry; per delta it was ~4 % of the gateway's CPU at 200 streams).
        self._uncounted_tokens: dict[str, int] = {}
        self.worker_port = WorkerPort(self, settings)  # where worker processes connect (gateway/dispatch/links/tcp.py)
        # What the gateway serves, by name: a worker must announce the same tokenizer and at least
        # this context length (set by the backend from models.toml before start()).
        self.expected_models: dict[str, ServedModelInfo] = {}
        self.announced_models: set[str] = set()  # served by some worker since this process started
        self._started_at = time.monotonic()
        self._grace_s = settings.dispatch.announce_grace_s

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self, host: str | None = None, port: int | None = None, *, worker_port: bool = True) -> None:
        """Starts dispatching; `worker_port=False`: no worker process may connect (only links
        attached in this process serve, gateway/queueing/backend.py's LocalEngineBackend)."""
        gw = self.settings.gateway
        host = gw.worker_host if host is None else host
        port = gw.worker_port if port is None else port
        # First: a missing API key variable is a start error before anything listens.
        self.upstreams = [UpstreamLink(spec, self, self.settings) for spec in self.settings.upstreams]
        self._started_at = time.monotonic()
        if worker_port:
            await self.worker_port.start(host, port)
        self._tasks = [asyncio.create_task(self._dispatch_loop(), name="dispatch"),
                       asyncio.create_task(self._monitor_loop(), name="worker-monitor")]
        for link in self.upstreams:
            link.start()
        if isinstance(self.slots, RedisSlots):
            await self.slots.start()
        if self.fairness is not None:
            await self.fairness.start()

    async def stop(self) -> None:
        self.worker_port.close()
        for task in self._tasks:
            task.cancel()
        for worker in list(self.workers.values()):
            self._lose_worker(worker, "gateway stopping")
        for link in self.upstreams:
            await link.shutdown()
        await self.worker_port.wait_closed()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        with contextlib.suppress(TimeoutError):  # Redis gone: the lease sweep ends the rest
            if isinstance(self.slots, RedisSlots):
                await asyncio.wait_for(self.slots.flush(), 5.0)
                await self.slots.stop()
            if self.fairness is not None:
                await asyncio.wait_for(self.fairness.stop(), 5.0)

    @property
    def port(self) -> int:
        """The worker port's (its own when configured as 0)."""
        return self.worker_port.port

    # ---- jobs ----------------------------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._jobs

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def request_ids(self) -> set[str]:
        """The ids of every job queued or on a worker."""
        return set(self._jobs)

    def enqueue(self, job: Job) -> None:
        request = job.request
        if request.request_id in self._jobs:
            raise ValueError(f"request {request.request_id} is already queued or running")
        job.state.queued_at = time.time()
        self.scheduler.push(Pending(  # first: it refuses a bad item, which must leave no trace here
            request_id=request.request_id, tenant=request.tenant_id, priority=request.priority,
            enqueued_at=job.enqueued_at, payload=job, prompt_tokens=len(request.prompt_token_ids),
            weight=request.tenant_weight,
        ))
        self._jobs[request.request_id] = job
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Client gone: drop the job if still queued, else abort it at its worker."""
        job = self._jobs.get(request_id)
        if job is None:
            return
        if not job.worker:
            self.scheduler.remove(request_id)
            self._finish(job, RequestDelta(request_id=request_id, finish_reason=FinishReason.ABORT,
                                           num_prompt_tokens=len(job.request.prompt_token_ids)))
            return
        worker = self.workers.get(job.worker)
        if worker is not None:
            worker.abort(request_id)

    def fail_queued(self, model: str, error: str) -> int:
        """Ends the jobs queued for `model` with `error` when no worker serves it any more (an
        in-process engine failed: nothing reconnects, so they would wait until their deadline);
        with another worker still serving it they wait for it. Returns how many ended."""
        if any(model in worker.models for worker in self.workers.values()):
            return 0
        queued = [item for item in self.scheduler.items() if item.payload.request.model == model]
        for item in queued:
            self.scheduler.remove(item.request_id)
            self._finish(item.payload, RequestDelta(request_id=item.request_id, finish_reason=FinishReason.ERROR,
                                                    error=error, num_prompt_tokens=item.prompt_tokens))
        return len(queued)

    def drain(self, worker_id: str) -> bool:
        """No new jobs for this worker; its running ones finish. False when no such worker is connected."""
        if worker_id not in self.workers:
            return False
        self.draining.add(worker_id)
        return True

    def undrain(self, worker_id: str) -> bool:
        """Back in service. False when it was not draining."""
        if worker_id not in self.draining:
            return False
        self.draining.discard(worker_id)
        self._wake.set()
        return True

    def could_serve(self, model: str) -> bool:
        """A model that some worker announced since this gateway started (its workers may be down for
        now: its requests wait for one), or any configured model during the first
        `dispatch.announce_grace_s` after start, while workers (re)connect and load."""
        if model in self.announced_models:
            return True
        return model in self.expected_models and time.monotonic() - self._started_at < self._grace_s

    def upstream_context(self, model: str) -> int | None:
        """The smallest `max_model_len` the upstreams serving `model` publish (None: none known)."""
        known = [link.max_model_lens[model] for link in self.upstreams if model in link.max_model_lens]
        return min(known) if known else None

    def _count_tokens(self) -> None:
        """The streamed tokens not counted yet go to the metrics."""
        uncounted, self._uncounted_tokens = self._uncounted_tokens, {}
        for worker_id, tokens in uncounted.items():
            telemetry.count_worker_tokens(worker_id, tokens)

    def _finish(self, job: Job, delta: RequestDelta) -> None:
        """Ends a job with its final delta: a worker's (folded in already), or one made here (an
        abort while queued, a lost worker, a model nobody serves), folded in now."""
        self._count_tokens()  # before its sink ends the request: its tokens are in the metrics then
        if job.state.finish_reason is None:
            job.state.take_output(delta)
        self._jobs.pop(job.request_id, None)
        try:
            job.sink(delta)
        finally:
            job.sink = ended_sink  # its sink's owner may hold the job: no cycle outlives the request
            self._on_finished(job, delta)
        self._wake.set()

    # ---- dispatch ------------------------------------------------------------------------------

    def _serving(self, request: GenerateRequest) -> list[WorkerLink]:
        """The workers that may serve `request` now (under their own cap)."""
        model = request.model
        # A resumed job goes to worker processes only: an upstream would start it over.
        resumed = bool(request.resume_token_ids)
        return [w for w in self.workers.values()
                if model in w.models and w.worker_id not in self.draining and w.accepting
                and (w.resumes or not resumed)]

    def _candidates(self, job: Job) -> list[WorkerLink]:
        """The workers `job` may be sent to now (under their own cap; within routing's reach:
        Router.in_reach), in routing's order (best first). `job.ranking` keeps every candidate."""
        job.ranking = self.router.rank(self._serving(job.request), self._prompt_blocks(job))
        return [d.worker for d in self.router.in_reach(job.ranking, job.held_since, time.monotonic())]

    def _hold(self, job: Job, held: set[str]) -> None:
        """`job` waits for room on the worker holding its prefix: passed over for this round
        without refusing its class (the next tenant's job may fit where it did not)."""
        if job.held_since is None:
            job.held_since = time.monotonic()
        held.add(job.request_id)

    def predicted_ttft(self, request: GenerateRequest) -> float | None:
        """Seconds to the first token of `request` (not queued yet) at the best worker serving its
        model, by this replica's view (dispatch/ttft.py); None when no worker is predictable.
        Ahead of it: each worker's own backlog, and the prompts queued here of its class and more
        urgent ones, taken as spread evenly over the workers (another replica's queue is not seen);
        while no worker has room for it, the wait for room of each of those and its own (RoomPace)."""
        serving = self._serving(request)
        if not serving:
            return None
        limit, by_class = self.settings.dispatch.max_worker_waiting, self.settings.scheduler.priority_enabled
        if not by_class:  # one class: queued in one lane, and sent as standard (`_send`)
            request = msgspec.structs.replace(request, priority=Priority.STANDARD)
        ahead = [item.prompt_tokens for item in self.scheduler.items()
                 if (item.priority <= request.priority or not by_class) and item.payload.request.model == request.model]
        blocks = PromptBlocks(request)
        pace = self.pace.seconds_per_job(request.model)
        if pace is not None and not any(room_for(w, request.priority, limit, by_class) for w in serving):
            # No room: it goes out after the jobs held ahead of it, one room gap each, then its own.
            # By then the worker's backlog is what it is now (its queue is kept this short).
            best = self.router.best_prediction(serving, blocks, sent_now=False)
            return None if best is None else (len(ahead) + 1) * pace + best
        return self.router.best_prediction(serving, blocks, queued_ahead=sum(ahead) // len(serving))

    @staticmethod
    def _prompt_blocks(job: Job) -> PromptBlocks:
        """The job's prompt block hashes (made again when a resume changed its request)."""
        blocks = job.prompt_blocks
        if blocks is None or blocks.request is not job.request:
            blocks = job.prompt_blocks = PromptBlocks(job.request)
        return blocks

    def _pick_worker(self, job: Job, held: set[str]) -> WorkerLink | None:
        assert isinstance(self.slots, LocalSlots)  # the shared round takes its slots in _dispatch_shared
        limit, by_class = self.settings.dispatch.max_worker_waiting, self.settings.scheduler.priority_enabled
        candidates = self._candidates(job)
        worker = self.slots.take(job, candidates, limit, by_class)
        if (worker is None and len(candidates) < len(job.ranking)
                and self.slots.take(job, [d.worker for d in job.ranking], limit, by_class) is not None):
            self._hold(job, held)
        return worker

    def _send(self, job: Job, worker: WorkerLink) -> None:
        state = job.state
        state.worker, job.started = worker.worker_id, False
        if state.dispatch_time is None:  # a resumed job keeps its first: records measure from it
            state.dispatch_time = time.time()
        state.attempts += 1
        decision = next((d for d in job.ranking if d.worker is worker), None)
        state.route = decision.reason if decision is not None else ""
        state.route_cached_tokens = decision.cached_tokens if decision is not None else 0
        job.ranking = []
        telemetry.count_route(state.route or "none")
        self.router.note_sent(worker, self._prompt_blocks(job))
        request = job.request
        if not self.settings.scheduler.priority_enabled and request.priority != Priority.STANDARD:
            # Priority off: the engine must not reorder by class either.
            request = msgspec.structs.replace(request, priority=Priority.STANDARD)
        worker.inflight[job.request_id] = job
        if request.traceparent is not None and tracing.enabled():
            sent = time.time()
            tracing.record_span("queue.wait", request.traceparent, state.queued_at or sent, sent,
                                {"sluice.class": request.priority.label})
            worker.send(request)
            tracing.record_span("dispatch", request.traceparent, sent, time.time(),
                                {"sluice.worker": worker.worker_id, "sluice.attempt": state.attempts})
            return
        worker.send(request)

    def _next(self, now: float, refused: set[tuple[str, Priority]], held: set[str],
              choose: Callable[[Job], _Target | None]) -> tuple[Pending[Job], _Target] | None:
        """The first queued item in dispatch order that `choose` finds a target for, with it; the
        item stays queued. A (model, class) `choose` refuses stays refused for the round (in
        `refused`): sending only fills workers, and a long queue for a model nobody serves costs
        one look per item. A job `choose` held back (put in `held`) is passed over for the round,
        its class not refused."""
        chosen: list[_Target] = []

        def accept(item: Pending[Job]) -> bool:
            key = (item.payload.request.model, item.priority)
            if key in refused or item.payload.request_id in held:
                return False
            target = choose(item.payload)
            if target is None:
                if item.payload.request_id not in held:
                    refused.add(key)
                return False
            chosen.append(target)
            return True

        item = self.scheduler.first(now, accept)
        return None if item is None else (item, chosen[0])

    def dispatch_ready(self) -> int:
        """Send queued jobs to workers with room (this process's view); returns how many went out.
        `self.held` says whether some job was held back for its prefix's worker."""
        sent = 0
        now = time.time()
        refused: set[tuple[str, Priority]] = set()
        held: set[str] = set()
        queued: Counter[str] | None = None
        while (found := self._next(now, refused, held, lambda job: self._pick_worker(job, held))) is not None:
            item, worker = found
            self.scheduler.claim(item)
            self._send(item.payload, worker)
            queued = self._note_pace(item.payload, queued)
            sent += 1
        self.held = bool(held)
        return sent

    async def _dispatch_shared(self, slots: RedisSlots) -> bool:
        """One round with shared slots: jobs in the scheduler's order, each sent only once the
        store gave it a slot on a worker (the first candidate, least loaded first, with room by
        every replica's counts). Returns whether the store refused some job (to be tried again
        soon, should an announced release be missed)."""
        now = time.time()
        limit, by_class = self.settings.dispatch.max_worker_waiting, self.settings.scheduler.priority_enabled
        refused: set[tuple[str, Priority]] = set()
        held: set[str] = set()
        store_refused = False
        queued: Counter[str] | None = None
        while (found := self._next(now, refused, held, lambda job: self._candidates(job) or None)) is not None:
            item, candidates = found
            job = item.payload
            lane = item.priority if by_class else Priority.STANDARD  # the scheduler's lane for it
            worker = await slots.take(job, candidates, limit, by_class,
                                      counter=self.scheduler.counter(lane, item.tenant))
            if worker is None:
                if len(candidates) < len(job.ranking):
                    self._hold(job, held)  # its prefix's workers are full: the next job may fit
                else:
                    refused.add((job.request.model, item.priority))
                store_refused = True
                continue
            if (self._jobs.get(job.request_id) is not job or job.worker
                    or self.workers.get(worker.worker_id) is not worker or worker.worker_id in self.draining):
                slots.release(job)  # cancelled, or its worker lost or drained, while the store answered
                continue
            self.scheduler.claim(item)
            self._send(job, worker)
            queued = self._note_pace(job, queued)
        return store_refused

    def _note_pace(self, job: Job, queued: Counter[str] | None) -> Counter[str]:
        """Tell `pace` that `job` (claimed: out of the scheduler) went out; `queued`: the jobs still
        queued by model, counted at a round's first send and kept by the round after it."""
        model = job.request.model
        if queued is None:
            queued = Counter(item.payload.request.model for item in self.scheduler.items())
        else:
            queued[model] -= 1
        self.pace.sent(model, time.monotonic(), left_held=queued[model] > 0)
        return queued

    async def _dispatch_loop(self) -> None:
        retry_in: float | None = None
        while True:
            if retry_in is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), retry_in)
            self._wake.clear()
            retry_in = None
            try:
                if isinstance(self.slots, RedisSlots):
                    retry_in = SLOT_RETRY_S if await self._dispatch_shared(self.slots) else None
                    if self._slot_error:
                        log.info("shared state: worker slots reachable again; dispatching")
                        self._slot_error = False
                else:
                    self.dispatch_ready()
                    retry_in = HELD_RETRY_S if self.held else None
            except RedisError as exc:  # fail closed: nothing is sent without a slot
                if not self._slot_error:
                    log.error("shared state: Redis unreachable, queued jobs wait for it (%s)", exc)
                    self._slot_error = True
                retry_in = SLOT_ERROR_RETRY_S
            except Exception:  # a bug here must not stop dispatching for good
                log.exception("dispatch failed")

    async def _monitor_loop(self) -> None:
        d = self.settings.dispatch
        while True:
            await asyncio.sleep(d.heartbeat_interval_s)
            self._count_tokens()  # long streams show in the metrics before they end
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if now - worker.last_seen > d.heartbeat_timeout_s:
                    log.warning("worker %s missed heartbeats for %.1fs; dropping it",
                                worker.worker_id, now - worker.last_seen)
                    self._lose_worker(worker, "stopped sending heartbeats")
            for worker in self.workers.values():
                telemetry.set_cache_index_blocks(worker.worker_id, len(worker.cache))
            self._publish_queues()

    def _publish_queues(self) -> None:
        """Waiting and running requests per class, and per tenant and class, to the metrics."""
        waiting = [(item.payload.state.tenant_name, item.priority.label) for item in self.scheduler.items()]
        running = [(job.state.tenant_name, job.request.priority.label)
                   for worker in self.workers.values() for job in worker.inflight.values()]
        for p in Priority:
            telemetry.set_queue_depth(p.label, sum(1 for _, label in waiting if label == p.label))
            telemetry.set_running(p.label, sum(1 for _, label in running if label == p.label))
        telemetry.set_tenant_queues(waiting, running)
        telemetry.WORKERS_CONNECTED.set(len(self.workers))

    # ---- worker connections --------------------------------------------------------------------

    def attach(self, link: WorkerLink) -> bool:
        """A worker ready for jobs; False when its id is taken by another live one (never replaced)."""
        if self.workers.get(link.worker_id, link) is not link:
            return False
        self.workers[link.worker_id] = link
        self.announced_models.update(link.models)
        self._wake.set()
        return True

    def deliver(self, worker: WorkerLink, delta: RequestDelta) -> None:
        """A delta of a job `worker` holds, from whichever kind of link."""
        worker.last_seen = time.monotonic()
        self._on_delta(worker, delta)

    def report(self, worker: EngineLink, capacity: WorkerCapacity) -> None:
        """An engine host's capacity report (on every change and as a heartbeat)."""
        before = worker.take_report(capacity)
        telemetry.observe_worker(capacity)
        telemetry.count_engine_events(before, capacity)
        self._wake.set()

    def kv_events(self, worker: EngineLink, events: KvEvents) -> None:
        """One engine step's prefix-cache changes at `worker`, into its index (a malformed batch is
        logged and ignored there)."""
        worker.last_seen = time.monotonic()
        if self.workers.get(worker.worker_id) is worker:
            worker.cache.apply(events)

    def wake(self) -> None:
        """Room may have come back at some worker: run a dispatch round."""
        self._wake.set()

    def lose(self, worker: WorkerLink, reason: str) -> None:
        """A link that can no longer reach its worker (see `_lose_worker`)."""
        if self.workers.get(worker.worker_id) is worker:
            self._lose_worker(worker, reason)

    def lose_job(self, worker: WorkerLink, request_id: str, reason: str) -> None:
        """One job's transport to its worker broke: handled as if its worker were lost, alone."""
        job = worker.inflight.pop(request_id, None)
        if job is not None:
            self._drop_job(job, worker, reason)
            self._wake.set()

    def _on_delta(self, worker: WorkerLink, delta: RequestDelta) -> None:
        job = worker.inflight.get(delta.request_id)
        if job is None:
            return  # a late delta of a job this gateway already gave up on
        if not job.started:
            job.started = True
            self.slots.release(job)  # it left the worker's waiting queue
        new_tokens = job.state.take_output(delta)
        if new_tokens > 0:
            self.scheduler.charge(job.request.tenant_id, job.request.priority, new_tokens)
            uncounted = self._uncounted_tokens
            uncounted[worker.worker_id] = uncounted.get(worker.worker_id, 0) + new_tokens
        if delta.finish_reason is None:
            job.sink(delta)
            return
        del worker.inflight[delta.request_id]
        if delta.num_prompt_tokens:
            totals = self.prefill_totals.setdefault(worker.worker_id, [0, 0])
            totals[0] += delta.num_prompt_tokens
            totals[1] += delta.num_cached_tokens
        self._finish(job, delta)

    def _lose_worker(self, worker: WorkerLink, reason: str) -> None:
        if self.workers.get(worker.worker_id) is worker:
            del self.workers[worker.worker_id]
        worker.close()
        jobs, worker.inflight = list(worker.inflight.values()), {}
        requeued = sum(self._drop_job(job, worker, reason) for job in jobs)
        log.warning("worker %s lost (%s): %d job(s) re-queued to resume elsewhere, %d failed",
                    worker.worker_id, reason, requeued, len(jobs) - requeued)
        self._wake.set()

    def _drop_job(self, job: Job, worker: WorkerLink, reason: str) -> bool:
        """A job whose worker is gone: back in line (True), or ended with an error: its attempts are
        spent, or it is a stream an upstream held (module docstring)."""
        self.slots.release(job)
        state = job.state
        if state.attempts >= MAX_DISPATCH_ATTEMPTS:
            error = (f"{state.attempts} workers serving this request were lost (the last, {worker.worker_id}, "
                     f"{reason}); it is not tried again")
        elif worker.resumes and state.resumable:
            # Resumed after what its sink already has; its timing and its tenant's charge so far stay.
            self._requeue(job, state.output_token_ids)
            return True
        elif job.request.batch_id is not None:  # an upstream's batch line: run again from scratch
            state.reset_output()
            self._requeue(job, ())
            return True
        else:
            error = f"the worker serving this request ({worker.worker_id}) {reason}; please retry"
        log.warning("request %s failed: %s", job.request_id, error)
        self._finish(job, RequestDelta(
            request_id=job.request_id, finish_reason=FinishReason.ERROR, error=error,
            num_prompt_tokens=len(job.request.prompt_token_ids),
            num_output_tokens=state.num_output_tokens,
        ))
        return False

    def _requeue(self, job: Job, resume: Sequence[int]) -> None:
        """Back into the scheduler, ahead of its tenant's newer work (its first place in line)."""
        state = job.state
        state.resume_after(resume)
        state.worker, job.started = "", False
        if not resume:  # nothing delivered: it starts over, dispatched anew
            state.dispatch_time = None
        self.scheduler.requeue(Pending(
            request_id=job.request_id, tenant=job.request.tenant_id, priority=job.request.priority,
            enqueued_at=job.enqueued_at, payload=job,
            prompt_tokens=len(job.request.prompt_token_ids), weight=job.request.tenant_weight,
        ))

    # ---- views ---------------------------------------------------------------------------------

    def workers_view(self) -> list[dict[str, Any]]:
        views = []
        for worker in self.workers.values():
            view = worker.view(worker.worker_id in self.draining)
            prompt, cached = self.prefill_totals.get(worker.worker_id, (0, 0))
            view.update(prompt_tokens=prompt, cached_prompt_tokens=cached,
                        cache_hit_rate=round(cached / prompt, 4) if prompt else None)
            views.append(view)
        return views
