"""The in-process kind of worker link: an engine host running in this process, on its own thread.

An `InProcessLink` is to an `EngineHost` (workers/engine_host.py) what a worker process's TCP
connection is: a client of the host, and a `WorkerLink` the dispatcher sends jobs to by the same
queue, room rule and failover as any other (gateway/dispatch/links/base.py). Only the transport differs:
requests and aborts go into the host's inbox directly, and what the host sends back (on its
engine thread) is handed to the event loop, one hand-off per step, not one per request.

A link that the dispatcher loses (missed heartbeats: the event loop or the engine thread was
starved) disconnects from its host, like a dropped connection, and `on_lost` may attach a fresh
one while the host still runs, as a worker process reconnects. A host that stops for good (its
engine failed) calls `on_host_gone` after the dispatcher lost the link: nothing will reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

from sluice.gateway.dispatch.links.base import EngineLink, LinkHost
from sluice.protocol import GenerateRequest, KvEvents, RequestDelta, WorkerCapacity
from sluice.workers.engine_host import EngineHost


class InProcessLink(EngineLink):
    """One model's in-process engine host as a worker (a `WorkerLink` and an `EngineClient`)."""

    kind = "in-process"

    def __init__(self, engine_host: EngineHost, model: str, dispatcher: LinkHost,
                 on_lost: Callable[[InProcessLink], None] | None = None,
                 on_host_gone: Callable[[str], None] | None = None, *, max_index_blocks: int = 1_000_000) -> None:
        super().__init__(engine_host.worker_id, frozenset({model}), engine_host.capacity(),
                         str(engine_host.engine.config.device), os.getpid(), max_index_blocks=max_index_blocks)
        self.engine_host = engine_host
        self._dispatcher = dispatcher
        self._loop = asyncio.get_running_loop()
        self._on_lost = on_lost
        self._on_host_gone = on_host_gone

    def connect(self) -> bool:
        """Registers with the host and the dispatcher; False when its worker id is taken."""
        if not self._dispatcher.attach(self):
            return False
        self.engine_host.connect(self)
        return True

    # ---- the WorkerLink side (on the event loop) -----------------------------------------------

    def _send(self, request: GenerateRequest) -> None:
        self.engine_host.add(self, request)

    def _abort(self, request_id: str) -> None:
        self.engine_host.abort(self, request_id)

    def close(self) -> None:
        self.engine_host.disconnect(self)
        if self._on_lost is not None:
            self._loop.call_soon(self._on_lost, self)

    # ---- the EngineClient side (on the engine thread) ------------------------------------------

    def on_deltas(self, deltas: list[RequestDelta]) -> None:
        self._post(self._deliver, deltas)

    def on_capacity(self, capacity: WorkerCapacity) -> None:
        self._post(self._dispatcher.report, self, capacity)

    def on_kv_events(self, events: KvEvents) -> None:
        self._post(self._dispatcher.kv_events, self, events)

    def on_closed(self, reason: str) -> None:
        self._on_lost = None  # the host is gone: nothing to reconnect to
        self._post(self._dispatcher.lose, self, reason)
        if self._on_host_gone is not None:
            self._post(self._on_host_gone, reason)

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed at shutdown
            self._loop.call_soon_threadsafe(callback, *args)

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            self._dispatcher.deliver(self, delta)
