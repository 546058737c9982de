"""The seam between the HTTP gateway and whatever generates tokens.

`GenerationBackend` is what the OpenAI routes talk to: `submit()` returns once a request is
accepted (durably, for the Kafka backend, queueing/acceptance.py) and yields its `RequestDelta`s.
`LocalEngineBackend` (queueing/local.py) is the dispatcher without Kafka, for tests and a no-Kafka
development mode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from sluice.protocol import GenerateRequest, RequestDelta

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
