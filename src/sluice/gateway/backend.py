"""The seam between the HTTP gateway and whatever generates tokens.

`GenerationBackend` is what the OpenAI routes talk to: `submit()` returns once a request is
accepted (durably, for the Kafka backend) and yields its `RequestDelta`s. `LocalEngineBackend`
is the dispatcher without Kafka: one in-process engine host per model (gateway/local_link.py),
attached as a worker link like any other, so requests are scheduled, dispatched, streamed and
failed as they are in production; for tests and a no-Kafka development mode. It has no
durability; a restart loses in-flight work.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sluice.gateway.dispatch import Dispatcher
from sluice.gateway.jobs import Job
from sluice.gateway.local_link import InProcessLink
from sluice.protocol import GenerateRequest, RequestDelta
from sluice.settings import Settings
from sluice.workers.engine_host import EngineHost

log = logging.getLogger(__name__)


class BackendUnavailable(Exception):
    """No worker/backend can take the request now; the gateway answers 503 with this message."""


@runtime_checkable
class Submission(Protocol):
    """One accepted request's stream of deltas; iteration ends after a delta with finish_reason."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestDelta]: ...

    async def abort(self) -> None:
        """The client went away: abort at the worker. Idempotent, safe after the end."""
        ...


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    path: str
    max_model_len: int


@runtime_checkable
class GenerationBackend(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def served_models(self) -> list[ServedModel]: ...

    def could_serve(self, model: str) -> bool:
        """Whether some worker serves (or, for a while after start, may yet serve) this model."""
        ...

    async def ready(self) -> dict[str, bool]: ...

    async def submit(self, request: GenerateRequest) -> Submission: ...

    def snapshot(self) -> dict[str, Any]: ...


# ---- in-process engine backend -----------------------------------------------------------------


class QueuedSubmission:
    """A Submission fed on the event loop through `deliver`; `abort` calls `on_abort` once.

    Both backends stream this way, from the dispatcher's sinks.
    """

    def __init__(self, request_id: str, on_abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._on_abort = on_abort
        self._queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._listener: Callable[[RequestDelta], None] | None = None
        self._finished = False
        self._aborted = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def deliver(self, delta: RequestDelta) -> None:
        listener = self._listener
        if listener is None:
            self._queue.put_nowait(delta)
            return
        if delta.finish_reason is not None:
            self._finished = True
            self._listener = None  # it holds its reader, which holds this: no cycle outlives the request
        listener(delta)

    def listen(self, listener: Callable[[RequestDelta], None]) -> None:
        """From now on each delta goes to `listener` within `deliver` (the deliverer's call: the
        stream pump frames and logs it there, with no task step per token), those queued first;
        the submission is not iterated any more. `listener` must not raise."""
        while not self._queue.empty():
            delta = self._queue.get_nowait()
            if delta.finish_reason is not None:
                self._finished = True
            listener(delta)
        if not self._finished:
            self._listener = listener

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        while not self._finished:
            delta = await self._queue.get()
            if delta.finish_reason is not None:
                self._finished = True
            yield delta

    async def abort(self) -> None:
        if self._aborted or self._finished:
            return
        self._aborted = True
        self._on_abort(self.request_id)


class LocalEngineBackend:
    """The dispatcher with one in-process engine host per model and no Kafka. No durability."""

    def __init__(
        self,
        models: Mapping[str, str | Path],
        engine_options: Mapping[str, Any] | None = None,
        *,
        worker_id: str = "local",
        settings: Settings | None = None,
    ) -> None:
        if not models:
            raise ValueError("LocalEngineBackend needs at least one model (name -> directory)")
        self._paths = {name: str(path) for name, path in models.items()}
        self._options = dict(engine_options or {})
        self._worker_id = worker_id
        self._settings = settings if settings is not None else Settings()
        self.dispatcher: Dispatcher | None = None
        self._hosts: dict[str, EngineHost] = {}
        self._stopping = False

    async def start(self) -> None:
        if self.dispatcher is not None:
            return
        from sluice.workers.config import EngineConfig
        from sluice.workers.engine import LLMEngine

        self._stopping = False
        self.dispatcher = Dispatcher(self._settings, lambda job, final: None)  # nothing to commit
        try:
            await self.dispatcher.start(worker_port=False)
            for name, path in self._paths.items():
                config = EngineConfig(model=path, **self._options)
                # Loading weights takes seconds: keep the event loop free meanwhile.
                engine = await asyncio.to_thread(LLMEngine, config)
                host = EngineHost(engine, f"{self._worker_id}-{name}",
                                  heartbeat_interval_s=self._settings.dispatch.heartbeat_interval_s)
                host.start_thread(f"engine-{name}")
                self._hosts[name] = host
                self._link(name)
        except BaseException:
            await self.stop()
            raise

    def _link(self, model: str) -> None:
        """Attaches a link to `model`'s host; again after the dispatcher lost one (missed
        heartbeats), as a worker process reconnects, while the host runs."""
        host = self._hosts.get(model)
        if self._stopping or self.dispatcher is None or host is None or not host.alive:
            return
        InProcessLink(host, model, self.dispatcher, on_lost=lambda _: self._link(model),
                      on_host_gone=lambda reason: self._host_gone(model, reason)).connect()

    def _host_gone(self, model: str, reason: str) -> None:
        """`model`'s engine host stopped for good: its queued jobs fail now, not at their deadline."""
        if self._stopping or self.dispatcher is None:
            return
        self.dispatcher.fail_queued(model, f"the engine serving model {model!r} stopped ({reason}); "
                                           "this gateway cannot serve it until restarted")

    async def stop(self) -> None:
        self._stopping = True
        dispatcher, self.dispatcher = self.dispatcher, None
        if dispatcher is not None:
            await dispatcher.stop()
        hosts, self._hosts = list(self._hosts.values()), {}
        for host in hosts:
            host.stop()
            await asyncio.to_thread(host.join, 10)

    def served_models(self) -> list[ServedModel]:
        return [
            ServedModel(name=name, path=self._paths[name], max_model_len=host.engine.max_model_len)
            for name, host in self._hosts.items()
        ]

    def could_serve(self, model: str) -> bool:
        return model in self._hosts

    def tokenizer(self, model: str) -> Any:
        """The loaded engine's tokenizer (saves the gateway loading it a second time)."""
        return self._hosts[model].engine.tokenizer

    async def ready(self) -> dict[str, bool]:
        return {"workers": bool(self._hosts) and all(h.alive for h in self._hosts.values())}

    async def submit(self, request: GenerateRequest) -> Submission:
        dispatcher = self.dispatcher
        host = self._hosts.get(request.model)
        if dispatcher is None or host is None or not host.alive:
            raise BackendUnavailable(f"no worker is serving model {request.model!r}")
        submission = QueuedSubmission(request.request_id, dispatcher.cancel)
        dispatcher.enqueue(Job(request=request, sink=submission.deliver))
        return submission

    def snapshot(self) -> dict[str, Any]:
        dispatcher = self.dispatcher
        if dispatcher is None:
            return {"queues": {"backend": "local", "in_flight": 0}, "workers": []}
        return {"queues": {"backend": "local", "in_flight": dispatcher.num_jobs}, "workers": dispatcher.workers_view()}
