"""Helpers the tests share: a backend's request from a bare `GenerateRequest`, the deltas of a
submission, usage records kept in memory (importable as `sluice_testing`: tests/conftest.py puts tests/ on the path)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn

from sluice.gateway.generation.prepare import CLASS_TO_TIER
from sluice.gateway.generation.state import RequestState
from sluice.gateway.queueing.backend import GenerationBackend, Submission
from sluice.gateway.quotas.usage import UsageService
from sluice.protocol import GenerateRequest, RequestDelta


class MemoryUsage:
    """`UsageService` without its database, for the unit tests of what records usage: each record
    kept as (tenant, model, prompt, completion, requests), written at once."""

    written = staticmethod(UsageService.written)

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []

    def record(self, request_id: str, *args: object, **kwargs: object) -> asyncio.Future[None]:
        self.rows.append((*args, kwargs.get("requests", 1)))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def state_of(request: GenerateRequest, *, stream: bool = True) -> RequestState:
    """The state a gateway would make for `request` (a chat completion of its tenant)."""
    return RequestState.of(request, CLASS_TO_TIER[request.priority], stream=stream)


class Followed:
    """A submitted request as a test reads it: its state (where it ran, its output so far) and its
    deltas, by async iteration (once)."""

    def __init__(self, submission: Submission, state: RequestState) -> None:
        self.submission = submission
        self.state = state

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def dispatch_time(self) -> float | None:
        return self.state.dispatch_time

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return each_delta(self.submission)

    async def abort(self) -> None:
        await self.submission.abort()


async def submit(backend: GenerationBackend, request: GenerateRequest) -> Followed:
    state = state_of(request)
    return Followed(await backend.submit(state), state)


async def each_delta(submission: Submission) -> AsyncIterator[RequestDelta]:
    """The submission's deltas as they come, the final one last."""
    queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
    submission.listen(queue.put_nowait)
    while True:
        delta = await queue.get()
        yield delta
        if delta.finish_reason is not None:
            return


async def drain(submission: Submission | Followed) -> list[RequestDelta]:
    """Every delta of the submission, once it ended."""
    if isinstance(submission, Followed):
        submission = submission.submission
    return [delta async for delta in each_delta(submission)]


def free_socket() -> socket.socket:
    """A bound loopback socket on a free port (for a server started on it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Serves an ASGI app with uvicorn on a thread at a free loopback port; yields its base URL and
    stops it (lifespan included) on exit."""
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300  # the lifespan loads the models: minutes for a real one on a loaded host
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
