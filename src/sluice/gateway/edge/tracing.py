"""The gateway's server span per HTTP request (installed only while `[tracing] enabled`).

The span is the child of the client's W3C `traceparent` header when it sent one, and current for
the whole request (the guard's `authenticate`, quota `admission`, the `kafka.append` and the
request's `GenerateRequest.traceparent` hang under it). A streamed answer is one ASGI call, so the
span ends with the stream's last byte. Overview: sluice/tracing.py.
"""

from __future__ import annotations

from typing import Any

from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from sluice import tracing


class TracingMiddleware(ASGIMiddleware):
    scopes = ("http",)  # type: ignore[assignment]

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k == b"traceparent"}
        method, path = scope.get("method", ""), scope.get("path", "")
        attributes = {"http.request.method": method, "url.path": path}
        with tracing.span(f"{method} {path}", context=tracing.extract(headers), kind="server",
                          attributes=attributes) as span:

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    _status(span, message["status"])
                await send(message)

            await next_app(scope, receive, traced_send)


def _status(span: Any, status: int) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("http.response.status_code", status)
    if status >= 500:  # a 4xx is the client's fault: not an error of this span (OTel HTTP conventions)
        span.set_status(Status(StatusCode.ERROR))
