"""The seam between the HTTP gateway and whatever generates tokens.

`GenerationBackend` is what the OpenAI routes talk to: `submit()` returns once a request is
accepted (durably, for the Kafka backend) and yields its `RequestDelta`s. `LocalEngineBackend`
runs one in-process `LLMEngine` per model, stepped in a background thread: for tests and a
no-Kafka development mode. It has no durability; a restart loses in-flight work.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sluice.protocol import FinishReason, GenerateRequest, RequestDelta

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

    Both backends stream this way: the local one from its engine thread, the Kafka one from the
    dispatcher's worker connections.
    """

    def __init__(self, request_id: str, on_abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._on_abort = on_abort
        self._queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._finished = False
        self._aborted = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def deliver(self, delta: RequestDelta) -> None:
        self._queue.put_nowait(delta)

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


class _EngineThread:
    """Owns one LLMEngine; every engine call happens on this thread.

    The event loop hands it adds and aborts through a locked deque; it hands back each step's
    deltas in ONE `call_soon_threadsafe` (not one per request), so 200 streams cost one wakeup.
    """

    def __init__(self, name: str, engine: Any, worker_id: str) -> None:
        self.name = name
        self.engine = engine
        self.worker_id = worker_id
        self._commands: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._subs: dict[str, QueuedSubmission] = {}  # touched on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.last_capacity = engine.capacity(worker_id)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def live_requests(self) -> int:
        return len(self._subs)

    def submit(self, request: GenerateRequest) -> QueuedSubmission:
        if request.request_id in self._subs:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        sub = QueuedSubmission(request.request_id, self.abort)
        self._subs[request.request_id] = sub
        self._push(("add", request))
        return sub

    def abort(self, request_id: str) -> None:
        self._push(("abort", request_id))

    def _push(self, command: tuple[str, Any]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _dispatch(self, deltas: list[RequestDelta]) -> None:  # on the event loop
        for delta in deltas:
            sub = self._subs.get(delta.request_id)
            if sub is None:
                continue
            if delta.finish_reason is not None:
                del self._subs[delta.request_id]
            sub.deliver(delta)

    def _apply(self, command: tuple[str, Any], out: list[RequestDelta]) -> None:
        kind, arg = command
        if kind == "abort":
            self.engine.abort(arg)
            return
        request: GenerateRequest = arg
        try:
            self.engine.add_request(
                request.request_id,
                list(request.prompt_token_ids),
                request.sampling,
                priority=int(request.priority),
                cache_salt=request.cache_salt,
                arrival_time=request.arrival_time,
            )
        except ValueError as exc:  # the gateway validates first; this is a last line of defence
            out.append(
                RequestDelta(
                    request_id=request.request_id,
                    finish_reason=FinishReason.ERROR,
                    error=str(exc),
                    num_prompt_tokens=len(request.prompt_token_ids),
                )
            )

    def _run(self) -> None:
        assert self._loop is not None
        while True:
            with self._wake:
                while not self._commands and not self._stopping and not self.engine.has_work:
                    self._wake.wait()
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            out: list[RequestDelta] = []
            for command in commands:
                self._apply(command, out)
            try:
                if self.engine.has_work:
                    out.extend(self.engine.step())
                    self.steps += 1
                self.last_capacity = self.engine.capacity(self.worker_id)
            except Exception as exc:  # a broken engine must end streams, not hang them
                log.exception("engine %s failed a step", self.name)
                out.extend(self._fail_all(str(exc) or type(exc).__name__))
            if out:
                self._loop.call_soon_threadsafe(self._dispatch, out)

    def _fail_all(self, message: str) -> list[RequestDelta]:
        failed = []
        for request_id in list(self._subs):
            self.engine.abort(request_id)
            failed.append(
                RequestDelta(
                    request_id=request_id, finish_reason=FinishReason.ERROR, error=f"engine error: {message}"
                )
            )
        return failed


class LocalEngineBackend:
    """In-process engines, one per model, each stepped by its own thread. No durability."""

    def __init__(
        self,
        models: Mapping[str, str | Path],
        engine_options: Mapping[str, Any] | None = None,
        *,
        worker_id: str = "local",
    ) -> None:
        if not models:
            raise ValueError("LocalEngineBackend needs at least one model (name -> directory)")
        self._paths = {name: str(path) for name, path in models.items()}
        self._options = dict(engine_options or {})
        self._worker_id = worker_id
        self._runners: dict[str, _EngineThread] = {}
        self._started = False

    async def start(self) -> None:
        if self._started:
            return
        from sluice.workers.config import EngineConfig
        from sluice.workers.engine import LLMEngine

        loop = asyncio.get_running_loop()
        for name, path in self._paths.items():
            config = EngineConfig(model=path, **self._options)
            # Loading weights takes seconds: keep the event loop free meanwhile.
            engine = await asyncio.to_thread(LLMEngine, config)
            runner = _EngineThread(name, engine, f"{self._worker_id}-{name}")
            runner.start(loop)
            self._runners[name] = runner
        self._started = True

    async def stop(self) -> None:
        runners, self._runners = list(self._runners.values()), {}
        for runner in runners:
            await asyncio.to_thread(runner.stop)
        self._started = False

    def served_models(self) -> list[ServedModel]:
        return [
            ServedModel(name=name, path=self._paths[name], max_model_len=runner.engine.max_model_len)
            for name, runner in self._runners.items()
        ]

    def could_serve(self, model: str) -> bool:
        return model in self._runners

    def tokenizer(self, model: str) -> Any:
        """The loaded engine's tokenizer (saves the gateway loading it a second time)."""
        return self._runners[model].engine.tokenizer

    async def ready(self) -> dict[str, bool]:
        return {"workers": bool(self._runners) and all(r.alive for r in self._runners.values())}

    async def submit(self, request: GenerateRequest) -> Submission:
        runner = self._runners.get(request.model)
        if runner is None or not runner.alive:
            raise BackendUnavailable(f"no worker is serving model {request.model!r}")
        return runner.submit(request)

    def snapshot(self) -> dict[str, Any]:
        workers = []
        for name, runner in self._runners.items():
            cap = runner.last_capacity
            workers.append(
                {
                    "worker_id": runner.worker_id,
                    "models": [name],
                    "alive": runner.alive,
                    "num_running": cap.num_running,
                    "num_waiting": cap.num_waiting,
                    "free_kv_blocks": cap.free_kv_blocks,
                    "total_kv_blocks": cap.total_kv_blocks,
                    "max_num_seqs": cap.max_num_seqs,
                    "steps": runner.steps,
                }
            )
        return {
            "queues": {"backend": "local", "in_flight": sum(r.live_requests for r in self._runners.values())},
            "workers": workers,
        }
