"""The HTTP response of a stream's follower: its SSE events written with plain ASGI `send` calls.

Litestar's `Stream` builds an `ASGIStreamingResponse` per request (header normalisation, iterator
checks) and runs it in an anyio task group: a second task for the events and cancel scopes around
both. At 200 concurrent streams on one core that machinery was ~10 % of the gateway's CPU. Here
the events are written from the handler's own task, each batch the follower found waiting in one
`send` (`StreamHub.follow` joins them), and a watcher task that waits for `http.disconnect`
cancels it when the client goes away, which detaches the follower (its pump starts the grace).
The bytes and headers on the wire are the same as `Stream`'s.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from litestar import Response
from litestar.response.base import ASGIResponse

if TYPE_CHECKING:
    from litestar import Litestar, Request
    from litestar.background_tasks import BackgroundTask, BackgroundTasks
    from litestar.datastructures import Cookie
    from litestar.types import HTTPResponseBodyEvent, Receive, Scope, Send, TypeEncodersMap


class Events(Protocol):
    """What a response writes: its chunks, and `aclose()`, which the response always calls at its
    end (read to the end or not, started or not: an async generator that never started skips its
    `finally`, so a source that must clean up then is an object of its own, streams/choices.py)."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class SSEResponse(Response[bytes]):
    """A Litestar response (handlers and hooks see a `Response`) whose ASGI response is `_SSEBody`."""

    __slots__ = ("events",)

    def __init__(self, events: Events, headers: dict[str, str]) -> None:
        super().__init__(b"", media_type="text/event-stream", headers=headers)
        self.events = events

    def to_asgi_response(
        self,
        app: Litestar | None,
        request: Request[Any, Any, Any],
        *,
        background: BackgroundTask | BackgroundTasks | None = None,
        cookies: Iterable[Cookie] | None = None,
        encoded_headers: Iterable[tuple[bytes, bytes]] | None = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: Any = None,
        status_code: int | None = None,
        type_encoders: TypeEncodersMap | None = None,
    ) -> ASGIResponse:
        return _SSEBody(
            self.events,
            background=self.background or background,
            cookies=self.cookies if cookies is None else itertools.chain(self.cookies, cookies),
            headers={**headers, **self.headers} if headers else self.headers,
            is_head_response=is_head_response,
            media_type="text/event-stream",  # sent as "text/event-stream; charset=utf-8", as by `Stream`
            status_code=self.status_code or status_code,
        )


class _SSEBody(ASGIResponse):
    """`ASGIResponse` (its start message and headers) with the events as its body."""

    __slots__ = ("events",)

    _should_set_content_length: ClassVar[bool] = False

    def __init__(self, events: Events, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()  # its cleanup (the follower detaches) also when it never started

    async def send_body(self, send: Send, receive: Receive) -> None:
        if await _write(self.events, receive, send):
            end: HTTPResponseBodyEvent = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(end)


async def _write(events: Events, receive: Receive, send: Send) -> bool:
    """Each chunk of `events` as one body message, until they end (True) or the client goes away
    (False)."""
    task = asyncio.current_task()
    assert task is not None  # an ASGI app runs in a task
    gone = False

    async def disconnected() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(disconnected())
    try:
        async for chunk in events:
            body: HTTPResponseBodyEvent = {"type": "http.response.body", "body": chunk, "more_body": True}
            await send(body)
        return True
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (the server stops)
        task.uncancel()
        await events.aclose()
        return False
    finally:
        watcher.cancel()
