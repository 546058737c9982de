"""The engine host: the one loop that steps an LLMEngine and serves it to its clients.

Every way of reaching an engine goes through an `EngineHost` (the way vLLM v1 has one EngineCore
and several clients): a worker process's TCP connections to its gateways (workers/server.py) and
the gateway's in-process link (gateway/dispatch/links/inprocess.py) are both `EngineClient`s of it. What a host
does, it does once for every kind:
- `add` / `abort` from any thread, through one locked inbox, applied on the engine thread between
  steps (a step never delays reading an abort by more than one step);
- every request in the engine has one owner, the client it came from (`_owners`): its deltas go
  back to that client only, only that client may abort it, and a request id already in the
  engine that arrives again (from any client) is answered with an error final delta there, the
  running request untouched;
- a request the engine refuses (`add_request` raises) gets an error final delta;
- a client that disconnects has its requests aborted in the engine (nobody listens for them);
- capacity (`WorkerCapacity`, with the requests received from that client as `num_received`)
  goes to every client on every change and as a heartbeat;
- an engine whose step raises (the engine itself failing: it already fails a request that raises
  alone) fails every request with an error delta, tells every client it is closed, and `run()`
  raises: a broken engine is not served from.
Each step's deltas reach a client in one call (`EngineClient.on_deltas`), so 200 streams cost a
client one hand-off per step, not 200. With `kv_events` on, each step's prefix-cache changes
(`KvEvents`: blocks cached and evicted) go to every client after its deltas, one batch per step;
the gateways route by them (gateway/dispatch/routing.py).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from sluice import tracing
from sluice.protocol import FinishReason, GenerateRequest, KvEvents, RequestDelta, WorkerCapacity

log = logging.getLogger(__name__)


class EngineClient(Protocol):
    """One connection to a host. Called on the engine thread: hand off, never block."""

    def on_deltas(self, deltas: list[RequestDelta]) -> None:
        """One step's deltas of this client's requests, in order."""
        ...

    def on_capacity(self, capacity: WorkerCapacity) -> None: ...

    def on_kv_events(self, events: KvEvents) -> None:
        """One step's prefix-cache changes (sent to every client; a client may drop them)."""
        ...

    def on_closed(self, reason: str) -> None:
        """The host stopped (its engine failed, or `stop()`): nothing more comes."""
        ...


@dataclass(slots=True)
class _ClientState:
    received: int = 0  # requests received from it (WorkerCapacity.num_received)
    last_capacity: tuple[int, ...] | None = None
    last_sent: float = 0.0


@dataclass(slots=True)
class _Trace:
    """A traced request's context and the engine's timestamps so far (unix s)."""

    traceparent: str
    received: float
    first_scheduled: float | None = None
    first_token: float | None = None


_Command = Callable[[], None]  # run on the engine thread, between steps


class EngineHost:
    """Steps one LLMEngine for its clients until `stop()` (module docstring)."""

    def __init__(self, engine: Any, worker_id: str, *, heartbeat_interval_s: float = 1.0,
                 kv_events: bool = True) -> None:
        self.engine = engine  # an LLMEngine: touched on the engine thread only, once running
        self.kv_events = kv_events
        engine.enable_kv_events(kv_events)
        self.worker_id = worker_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self._inbox: queue.Queue[_Command] = queue.Queue()
        self._stopping = threading.Event()
        self._failed = threading.Event()  # set before its clients hear of the failure
        self._clients: dict[EngineClient, _ClientState] = {}
        self._owners: dict[str, EngineClient] = {}  # every request in the engine, by id
        self._traces: dict[str, _Trace] = {}  # traced requests in the engine (sluice/tracing.py)
        self._thread: threading.Thread | None = None

    # ---- from any thread -----------------------------------------------------------------------

    def connect(self, client: EngineClient) -> None:
        self._inbox.put(lambda: self._connected(client))

    def disconnect(self, client: EngineClient) -> None:
        self._inbox.put(lambda: self._disconnected(client))

    def add(self, client: EngineClient, request: GenerateRequest) -> None:
        self._inbox.put(lambda: self._add(client, request))

    def abort(self, client: EngineClient, request_id: str) -> None:
        self._inbox.put(lambda: self._abort(client, request_id))

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(lambda: None)  # wakes the loop

    def start_thread(self, name: str) -> None:
        """Runs the loop on a thread of its own (the in-process kind); a failure is logged."""
        def run() -> None:
            with contextlib.suppress(Exception):  # logged by run(); its clients were told
                self.run()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        # False from the moment the engine failed, not only once its thread has ended: a request
        # submitted in between would otherwise be queued for an engine that will never serve it.
        return self._thread is not None and self._thread.is_alive() and not self._failed.is_set()

    def capacity(self, num_received: int = 0) -> WorkerCapacity:
        stats = self.engine.scheduler.stats
        return msgspec.structs.replace(self.engine.capacity(self.worker_id), num_received=num_received,
                                       num_preemptions=stats.num_preemptions,
                                       num_draft_tokens=stats.num_draft_tokens,
                                       num_accepted_draft_tokens=stats.num_accepted_draft_tokens)

    # ---- the loop (the engine thread) ----------------------------------------------------------

    def run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Steps until `stop()` or `keep_going()` is false; raises what the engine raised."""
        reason = "the engine host stopped"
        try:
            while not self._stopping.is_set() and keep_going():
                self._drain(block=not self.engine.has_work)
                if self.engine.has_work:
                    self._step()
                self._send_capacity()
        except Exception:
            reason = "its engine failed"
            self._failed.set()
            raise
        finally:
            for client in list(self._clients):
                client.on_closed(reason)
            self._clients.clear()

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception:
            log.exception("engine %s failed a step; failing its requests", self.worker_id)
            self._fail_all(f"the worker serving this request ({self.worker_id}) failed; please retry")
            raise
        self._route(deltas)
        if self.kv_events:
            events = self.engine.take_kv_events()  # taken even with no client: the log stays one step long
            if events is not None:
                for client in self._clients:
                    client.on_kv_events(events)

    def _drain(self, *, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=self.heartbeat_interval_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _connected(self, client: EngineClient) -> None:
        self._clients[client] = _ClientState()

    def _disconnected(self, client: EngineClient) -> None:
        if self._clients.pop(client, None) is not None:
            self._drop(client)

    def _abort(self, client: EngineClient, request_id: str) -> None:
        if self._owners.get(request_id) is client:  # only the sender may abort
            self.engine.abort(request_id)

    def _add(self, client: EngineClient, request: GenerateRequest) -> None:
        state = self._clients.get(client)
        if state is None:
            return  # from a client already gone: its requests were dropped
        state.received += 1
        rid = request.request_id
        if rid in self._owners:  # from another gateway (ids are unique per gateway), or a resend
            self._reply_error(client, request, f"request id {rid!r} is already running on this worker")
            return
        try:
            self.engine.add_request(rid, list(request.prompt_token_ids), request.sampling,
                                    priority=int(request.priority), cache_salt=request.cache_salt,
                                    arrival_time=request.arrival_time,
                                    resume_token_ids=request.resume_token_ids)
        except Exception as exc:  # bad prompt for this model, values the engine refuses
            if isinstance(exc, ValueError):  # written for users (SamplingParams.validate, add_request)
                text = str(exc)
            else:
                log.warning("request %s refused by the engine", rid, exc_info=True)
                text = "the worker could not accept this request's parameters"
            self._reply_error(client, request, text)
            return
        self._owners[rid] = client
        if request.traceparent is not None and tracing.enabled():
            self._traces[rid] = _Trace(request.traceparent, time.time())

    @staticmethod
    def _reply_error(client: EngineClient, request: GenerateRequest, text: str) -> None:
        client.on_deltas([RequestDelta(request_id=request.request_id, finish_reason=FinishReason.ERROR, error=text,
                                    num_prompt_tokens=len(request.prompt_token_ids))])

    def _drop(self, client: EngineClient) -> None:
        """Aborts the requests of a client that is gone. Their abort deltas are collected at once,
        before a resend under the same id (a gateway re-queues batch work) could be mistaken for
        them; the other clients' deltas of that step go out."""
        dropped = [rid for rid, owner in self._owners.items() if owner is client]
        for rid in dropped:
            del self._owners[rid]
            self.engine.abort(rid)
        if dropped:
            self._step()

    def _fail_all(self, text: str) -> None:
        failed: dict[EngineClient, list[RequestDelta]] = {}
        for rid, client in self._owners.items():
            failed.setdefault(client, []).append(
                RequestDelta(request_id=rid, finish_reason=FinishReason.ERROR, error=text))
        self._owners.clear()
        self._traces.clear()
        for client, deltas in failed.items():
            client.on_deltas(deltas)

    def _route(self, deltas: list[RequestDelta]) -> None:
        out: dict[EngineClient, list[RequestDelta]] = {}
        for delta in deltas:
            if self._traces:
                self._trace(delta)
            client = self._owners.get(delta.request_id)
            if client is None:
                continue  # an aborted request of a client that is gone
            if delta.finish_reason is not None:
                del self._owners[delta.request_id]
            if client in self._clients:
                out.setdefault(client, []).append(delta)
        for client, batch in out.items():
            client.on_deltas(batch)

    def _trace(self, delta: RequestDelta) -> None:
        """Keeps a traced request's engine timestamps; at its end, its spans (children of the
        gateway's request span): worker.queue, prefill, decode."""
        trace = self._traces.get(delta.request_id)
        if trace is None:
            return
        trace.first_scheduled = trace.first_scheduled or delta.first_scheduled_time
        trace.first_token = trace.first_token or delta.first_token_time
        if delta.finish_reason is None:
            return
        del self._traces[delta.request_id]
        now, parent = time.time(), trace.traceparent
        attributes = {"sluice.worker": self.worker_id, "sluice.request_id": delta.request_id}
        if trace.first_scheduled is not None:
            tracing.record_span("worker.queue", parent, trace.received, trace.first_scheduled, attributes)
            tracing.record_span("prefill", parent, trace.first_scheduled, trace.first_token or now,
                                {**attributes, "sluice.prompt_tokens": delta.num_prompt_tokens,
                                 "sluice.cached_tokens": delta.num_cached_tokens})
        if trace.first_token is not None:
            tracing.record_span("decode", parent, trace.first_token, now,
                                {**attributes, "sluice.output_tokens": delta.num_output_tokens,
                                 "sluice.finish_reason": str(delta.finish_reason)})

    def _send_capacity(self) -> None:
        now = time.monotonic()
        base: WorkerCapacity | None = None
        for client, state in self._clients.items():
            if base is None:
                base = self.capacity()
            key = (base.num_running, base.num_waiting, base.free_kv_blocks, state.received, base.num_preemptions)
            if key != state.last_capacity or now - state.last_sent >= self.heartbeat_interval_s:
                client.on_capacity(msgspec.structs.replace(base, num_received=state.received))
                state.last_capacity, state.last_sent = key, now
