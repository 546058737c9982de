"""The wait for a generation (or a stream's first delta) that a client disconnect cancels.

The disconnect arrives through the ASGI `receive` callable; its timing against the work (before
the first delta, after it, never) cannot be chosen through a real HTTP connection, so a stand-in
request object carries a queue as `receive` (the only part of the request that is used).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sluice.gateway.api.openai import _unless_disconnected
from sluice.gateway.edge.errors import OpenAIError

pytestmark = pytest.mark.unit


class _Client:
    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def receive(self) -> dict[str, Any]:
        return await self.messages.get()


async def test_the_result_comes_back_and_the_watcher_ends() -> None:
    client = _Client()
    before = len(asyncio.all_tasks())

    async def work() -> str:
        await asyncio.sleep(0.01)
        return "done"

    assert await _unless_disconnected(client, work()) == "done"  # type: ignore[arg-type]
    await asyncio.sleep(0)  # the cancelled watcher finishes
    assert len(asyncio.all_tasks()) == before


async def test_a_disconnect_cancels_the_work_runs_its_cleanup_and_is_a_499() -> None:
    client = _Client()
    cleaned = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.set()
        return "never"

    async def leave() -> None:
        await asyncio.sleep(0.01)
        await client.messages.put({"type": "http.disconnect"})

    leaving = asyncio.ensure_future(leave())
    with pytest.raises(OpenAIError) as info:
        await _unless_disconnected(client, work())  # type: ignore[arg-type]
    await leaving
    assert info.value.status == 499 and info.value.code == "client_closed_request"
    assert cleaned.is_set()
    # The handler's task is not left cancelling: its later awaits (and timeouts) work as before.
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    async with asyncio.timeout(5):
        await asyncio.sleep(0)


async def test_a_cancel_from_outside_stays_a_cancel() -> None:
    client = _Client()
    started = asyncio.Event()

    async def work() -> str:
        started.set()
        await asyncio.sleep(60)
        return "never"

    handler = asyncio.ensure_future(_unless_disconnected(client, work()))  # type: ignore[arg-type]
    await started.wait()
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
