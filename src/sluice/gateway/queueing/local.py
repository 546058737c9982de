"""`LocalEngineBackend`: the dispatcher without Kafka, for tests and a no-Kafka development mode.

One in-process engine host per model (gateway/dispatch/links/inprocess.py), attached as a worker
link like any other, so requests are scheduled, dispatched, streamed and failed as they are in
production. It has no durability; a restart loses in-flight work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sluice.gateway.dispatch.dispatcher import Dispatcher
from sluice.gateway.dispatch.jobs import Job
from sluice.gateway.dispatch.links.inprocess import InProcessLink
from sluice.gateway.generation.state import RequestState
from sluice.gateway.queueing.backend import BackendUnavailable, LinkLimits, QueuedSubmission, ServedModel, Submission
from sluice.protocol import GenerateRequest
from sluice.settings import Settings
from sluice.workers.engine_host import EngineHost


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
                      on_host_gone=lambda reason: self._host_gone(model, reason),
                      max_index_blocks=self._settings.routing.max_index_blocks).connect()

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

    def predicted_ttft(self, request: GenerateRequest) -> float | None:
        return None if self.dispatcher is None else self.dispatcher.predicted_ttft(request)

    def link_limits(self, model: str) -> LinkLimits:
        return LinkLimits()  # engines in this process: sluice's own checks are theirs

    def tokenizer(self, model: str) -> Any:
        """The loaded engine's tokenizer (saves the gateway loading it a second time)."""
        return self._hosts[model].engine.tokenizer

    async def ready(self) -> dict[str, bool]:
        return {"workers": bool(self._hosts) and all(h.alive for h in self._hosts.values())}

    async def submit(self, state: RequestState) -> Submission:
        dispatcher = self.dispatcher
        host = self._hosts.get(state.request.model)
        if dispatcher is None or host is None or not host.alive:
            raise BackendUnavailable(f"no worker is serving model {state.request.model!r}")
        submission = QueuedSubmission(state.request_id, dispatcher.cancel)
        dispatcher.enqueue(Job(state=state, sink=submission.deliver))
        return submission

    def snapshot(self) -> dict[str, Any]:
        dispatcher = self.dispatcher
        if dispatcher is None:
            return {"queues": {"backend": "local", "in_flight": 0}, "workers": []}
        return {"queues": {"backend": "local", "in_flight": dispatcher.num_jobs}, "workers": dispatcher.workers_view()}
