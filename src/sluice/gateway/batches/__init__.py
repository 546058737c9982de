"""The OpenAI Batch API: Files + Batches routes, the batch line runner and their tables.

`batch_components(settings)` gives `sluice serve` (and tests) what to wire: its `handler` (the
`BatchLineHandler`) for `KafkaBackend`, then the components themselves for `create_app(batches=...)`,
which builds the Batch API's service with its other services (`build`), serves its routes and
runs `start()` / `stop()` with the app. The handler exists before the app (the backend needs it
first) and forwards to the line runner once `build` made it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from sluice.settings import Settings

log = logging.getLogger(__name__)

ORPHAN_SWEEP_S = 15.0  # how often a live replica fails batches a dead replica left `validating`


class _DeferredHandler:
    """The BatchLineHandler given to KafkaBackend before the app exists; forwards once built.

    `prepare` holds a line that arrives before that (it only delays the batch topic's consumer).
    """

    def __init__(self) -> None:
        self.runner: Any = None
        self._attached: asyncio.Event | None = None

    def set_runner(self, runner: Any) -> None:
        self.runner = runner
        if self._attached is not None:
            self._attached.set()

    async def prepare(self, request: Any) -> bool:
        if self.runner is None:
            if self._attached is None:
                self._attached = asyncio.Event()
            await self._attached.wait()
        return await self.runner.prepare(request)

    def start(self, request: Any) -> Any:
        return self.runner.start(request)

    def failed(self, request: Any, error: str) -> Any:
        return self.runner.failed(request, error)

    async def persist(self, state: Any) -> None:
        await self.runner.persist(state)

    async def lost_lines(self, settled: Any) -> list[Any]:
        if self.runner is None:
            return []
        return await self.runner.service.lost_lines(settled)  # type: ignore[no-any-return]


@dataclass
class BatchComponents:
    settings: Settings
    handler: _DeferredHandler = field(default_factory=_DeferredHandler)
    service: Any = None
    _sweeper: asyncio.Task[None] | None = None

    @property
    def route_handlers(self) -> list[Any]:
        from sluice.gateway.batches.controllers import BatchesController, FilesController

        return [FilesController, BatchesController]

    def build(self, settings: Settings, session_factory: Any, generation: Any, backend: Any, shared: Any,
              quotas: Any, usage: Any, admin: Any) -> Any:
        """The Batch API's service, built with the app's other services (gateway/app.py); its line
        runner becomes what the backend's handler forwards to."""
        from sluice.gateway.batches.runner import BatchRunner
        from sluice.gateway.batches.service import BatchService

        self.service = BatchService(session_factory, generation, backend,
                                    max_file_bytes=settings.gateway.max_body_bytes,
                                    max_storage_bytes=settings.gateway.max_file_storage_bytes, shared=shared)
        runner = BatchRunner(self.service, quotas, usage)
        shared.bus.subscribe(runner.on_change)  # a tenant changed on any replica
        self.handler.set_runner(runner)
        service = self.service

        async def stop_tenant(tenant_id: str) -> None:
            runner.forget_tenant(tenant_id)
            await service.stop_tenant(tenant_id)

        admin.on_tenant_disabled.append(stop_tenant)
        return service

    async def start(self) -> None:
        if self.service is not None:
            await self.service.recover()
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_orphans(self.service))

    async def _sweep_orphans(self, service: Any) -> None:
        """Replicas outlive each other: a batch left `validating` by a replica that died is failed
        by a live one, not only at the next start. The same round measures the open batches'
        completion windows for the metrics (batches/window.py)."""
        from sluice import telemetry
        from sluice.gateway.batches import window

        while True:
            try:
                telemetry.BATCH_WINDOW.publish(await window.measure(service.sessions))
            except Exception as exc:  # the database is down: the last numbers stay, the next round retries
                log.warning("measuring the open batches failed (%r)", exc)
            await asyncio.sleep(ORPHAN_SWEEP_S)
            try:
                await service.fail_orphaned()
            except Exception as exc:  # the database is down: next time
                log.warning("checking for orphaned batches failed (%r)", exc)

    async def stop(self) -> None:
        if self.service is not None:
            self.service.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None


def batch_components(settings: Settings) -> BatchComponents:
    return BatchComponents(settings)
