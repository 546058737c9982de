"""The seam between the HTTP gateway and whatever generates tokens.

`GenerationBackend` is what the OpenAI routes talk to: `submit(state)` returns once a request is
accepted (durably, for the Kafka backend, queueing/acceptance.py) with its `Submission`, which
pushes the request's deltas to one listener. `LocalEngineBackend` (queueing/local.py) is the
dispatcher without Kafka, for tests and a no-Kafka development mode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sluice.protocol import GenerateRequest, RequestDelta

if TYPE_CHECKING:
    from sluice.gateway.generation.state import RequestState

log = logging.getLogger(__name__)


class BackendUnavailable(Exception):
    """No worker/backend can take the request now; the gateway answers 503 with this message."""


@runtime_checkable
class Submission(Protocol):
    """One accepted request's deltas, pushed to one listener in order, the final one last."""

    request_id: str

    def first(self) -> asyncio.Future[None]:
        """Done once a delta has arrived (none is taken: `listen` gets it)."""
        ...

    def listen(self, listener: Callable[[RequestDelta], None]) -> None:
        """From now on each delta goes to `listener` within its delivery, those queued first."""
        ...

    def refusal(self) -> RequestDelta | None:
        """The first delta (not taken) when it ends the request as refused by an upstream (an HTTP
        4xx there): a stream answers it as an HTTP error, not as an error event."""
        ...

    async def abort(self) -> None:
        """The client went away: abort at the worker. Idempotent, safe after the end."""
        ...


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    path: str
    max_model_len: int
    tool_parser: str | None = None  # models.toml's override of the tool-call format


@dataclass(frozen=True, slots=True)
class LinkLimits:
    """What the servers behind a model's links accept, beyond sluice's own checks: an [[upstreams]]
    server has its own context, and only a vllm one returns logprobs sluice can relay (docs/upstreams.md)."""

    max_model_len: int | None = None  # the smallest an upstream serving the model publishes
    logprobs: bool = True  # False when an upstream of kind openai serves the model (a job may go there)


@runtime_checkable
class GenerationBackend(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def served_models(self) -> list[ServedModel]: ...

    def could_serve(self, model: str) -> bool:
        """Whether some worker serves (or, for a while after start, may yet serve) this model."""
        ...

    def link_limits(self, model: str) -> LinkLimits:
        """What every link that may serve this model accepts (requests are checked against it)."""
        ...

    def predicted_ttft(self, request: GenerateRequest) -> float | None:
        """Seconds to its first token at the best worker, by this replica's view of the workers
        (gateway/dispatch/ttft.py); None when none can be predicted."""
        ...

    async def ready(self) -> dict[str, bool]: ...

    async def submit(self, state: RequestState) -> Submission:
        """Accepts the request (its deltas are folded into `state` as they arrive)."""
        ...

    def snapshot(self) -> dict[str, Any]: ...


class QueuedSubmission:
    """A Submission fed on the event loop through `deliver` (the dispatcher's sink for the job);
    deltas wait in a list until someone listens. `abort` calls `on_abort` once."""

    __slots__ = ("_aborted", "_finished", "_first", "_listener", "_on_abort", "_queued", "request_id")

    def __init__(self, request_id: str, on_abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._on_abort = on_abort
        self._queued: list[RequestDelta] = []
        self._listener: Callable[[RequestDelta], None] | None = None
        self._first: asyncio.Future[None] | None = None
        self._finished = False
        self._aborted = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def deliver(self, delta: RequestDelta) -> None:
        listener = self._listener
        if delta.finish_reason is not None:
            self._finished = True
            self._listener = None  # it holds its reader, which holds this: no cycle outlives the request
        if listener is None:
            self._queued.append(delta)
            if self._first is not None and not self._first.done():
                self._first.set_result(None)
            return
        listener(delta)

    def first(self) -> asyncio.Future[None]:
        if self._first is None:
            self._first = asyncio.get_running_loop().create_future()
            if self._queued or self._listener is not None:
                self._first.set_result(None)
        return self._first

    def refusal(self) -> RequestDelta | None:
        first = self._queued[0] if self._queued else None
        return first if first is not None and first.error_status is not None else None

    def listen(self, listener: Callable[[RequestDelta], None]) -> None:
        """`listener` must not raise. A listener is taken once; the submission is done with it at
        the final delta."""
        queued, self._queued = self._queued, []
        for delta in queued:
            listener(delta)
        if not self._finished:
            self._listener = listener

    async def abort(self) -> None:
        if self._aborted or self._finished:
            return
        self._aborted = True
        self._on_abort(self.request_id)
