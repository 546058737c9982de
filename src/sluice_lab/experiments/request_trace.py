"""Where one streamed request's time goes inside the gateway: checkpoints, for a bench only.

Installed in the gateway process by a sitecustomize.py on its PYTHONPATH (bench/trace_upstream_request.py
writes one) when SLUICE_REQUEST_TRACE_OUT is set: it wraps a few methods on the request path and
appends `<checkpoint> <perf_counter>` lines to that file. Nothing in the gateway knows about it,
and without the variable nothing is wrapped. Meant for concurrency 1: the lines of one request are
those between one `received` and the next. `time.perf_counter` is CLOCK_MONOTONIC on Linux, one
clock for every process on the machine, so the load client's send time lines up with these.

Checkpoints, in the order a request passes them:
  received        the ASGI app is called for the POST (uvicorn parsed the head)
  auth            the key's tenant is known (`AuthService.authenticate` returned)
  prepare         the handler runs (body decoded and validated into its struct)
  tokenized       `GenerationService.prepare` returned (chat template + tokenizer)
  admitted        the quota ledger admitted it (`QuotaService.admit` returned)
  append_sent     `RequestLog.append` called (the job has just been handed to the dispatcher)
  link_send       the dispatcher handed the job to the upstream link
  kafka_write     the producer wrote the append to the broker's socket
  upstream_sent   the upstream link wrote the request to the backend
  upstream_head   the backend's response head arrived
  append_acked    the broker acknowledged the append (acks=all)
  upstream_first  the first SSE event from the backend
  first_delta     the HTTP handler has the first delta (`Flight.first_delta` returned)
  sse_head        the response head was handed to uvicorn
  sse_first       the first body bytes (an SSE event) were handed to uvicorn
  sse_text        the first body bytes carrying text were handed to uvicorn
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable
from typing import Any

ENV_OUT = "SLUICE_REQUEST_TRACE_OUT"
ENV_PROFILE = "SLUICE_REQUEST_TRACE_PROFILE"  # also profile the gateway (cProfile) into this file
_TEXT = re.compile(rb'"(content|text)":"[^"]')  # an event carrying text (not the empty role chunk)

_fd = -1


def mark(name: str) -> None:
    if _fd >= 0:
        os.write(_fd, f"{name} {time.perf_counter():.6f}\n".encode())


def _after(owner: Any, attr: str, name: str, before: str | None = None) -> None:
    """Wraps the coroutine method `owner.attr`: marks `before` on entry and `name` on return."""
    original: Callable[..., Any] = getattr(owner, attr)

    @functools.wraps(original)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            mark(before)
        result = await original(*args, **kwargs)
        mark(name)
        return result

    setattr(owner, attr, wrapped)


def install() -> None:
    global _fd
    _fd = os.open(os.environ[ENV_OUT], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    from litestar import Litestar

    from sluice.gateway.auth.service import AuthService
    from sluice.gateway.dispatch.links import upstream_http
    from sluice.gateway.generation.flight import Flight
    from sluice.gateway.generation.service import GenerationService
    from sluice.gateway.queueing.kafka import RequestLog
    from sluice.gateway.quotas.service import QuotaService

    call = Litestar.__call__

    async def traced_call(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await call(self, scope, receive, send)
        mark("received")
        state = {"head": False, "first": False, "text": False}

        async def traced_send(message: Any) -> None:
            kind = message.get("type")
            if kind == "http.response.start" and not state["head"]:
                state["head"] = True
                mark("sse_head")
            elif kind == "http.response.body" and message.get("body"):
                if not state["first"]:
                    state["first"] = True
                    mark("sse_first")
                if not state["text"] and _TEXT.search(message["body"]):
                    state["text"] = True
                    mark("sse_text")
            await send(message)

        return await call(self, scope, receive, traced_send)

    Litestar.__call__ = traced_call  # type: ignore[method-assign]
    _after(AuthService, "authenticate", "auth")
    _after(GenerationService, "prepare", "tokenized", before="prepare")
    _after(QuotaService, "admit", "admitted")
    _after(RequestLog, "append", "append_acked", before="append_sent")
    _after(Flight, "first_delta", "first_delta")

    send = upstream_http.UpstreamHTTP._send

    async def traced_upstream_send(self: Any, conn: Any, request: bytes) -> Any:
        mark("upstream_sent")
        response = await send(self, conn, request)
        mark("upstream_head")
        return response

    from aiokafka.conn import AIOKafkaConnection

    from sluice.gateway.dispatch.links.upstream import UpstreamLink

    link_send = UpstreamLink.send

    def traced_link_send(self: Any, request: Any) -> None:
        mark("link_send")
        link_send(self, request)

    UpstreamLink.send = traced_link_send  # type: ignore[method-assign]
    conn_send = AIOKafkaConnection.send

    def traced_conn_send(self: Any, request: Any, expect_response: bool = True) -> Any:
        if "Produce" in type(request).__name__:
            mark("kafka_write")
        return conn_send(self, request, expect_response)

    AIOKafkaConnection.send = traced_conn_send
    upstream_http.UpstreamHTTP._send = traced_upstream_send  # type: ignore[method-assign]
    each_event = upstream_http.StreamedResponse.each_event

    async def traced_each_event(self: Any, on_event: Any, *, drain_s: float) -> None:
        first = True

        def traced_on_event(payload: bytes) -> bool:
            nonlocal first
            if first:
                first = False
                mark("upstream_first")
            return bool(on_event(payload))

        await each_event(self, traced_on_event, drain_s=drain_s)

    upstream_http.StreamedResponse.each_event = traced_each_event  # type: ignore[method-assign]


def _profile(path: str) -> None:
    """A deterministic profile of the whole process (cProfile), written at exit: where the CPU goes."""
    import atexit
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()

    def dump() -> None:
        profiler.disable()
        profiler.dump_stats(path)

    atexit.register(dump)


def start_from_env() -> None:
    if os.environ.get(ENV_OUT):
        install()
    if os.environ.get(ENV_PROFILE):
        _profile(os.environ[ENV_PROFILE])
