"""Helpers the integration tests share: a backend's request from a bare `GenerateRequest`, and the
deltas of a submission (importable as `sluice_testing`: tests/conftest.py puts tests/ on the path)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sluice.gateway.generation.prepare import CLASS_TO_TIER
from sluice.gateway.generation.state import RequestState
from sluice.gateway.queueing.backend import GenerationBackend, Submission
from sluice.protocol import GenerateRequest, RequestDelta


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
