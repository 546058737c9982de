"""The methods each path allows, for `Allow` on OPTIONS answers and on 405 answers.

Litestar 2 gives every path an automatic OPTIONS handler, but when a path's handlers are
registered one by one (a Controller does that) it keeps announcing the methods of the first
one only (litestar#4169, fixed in v3), and its 405 answers carry no `Allow` (litestar#4277).
Here the methods come from the application's final route table. OPTIONS is answered before
authentication: which methods a path has is public, the OpenAPI document says so too.
"""

from __future__ import annotations

import re
from typing import Any

from litestar.middleware import ASGIMiddleware
from litestar.routes import HTTPRoute
from litestar.types import ASGIApp, HTTPResponseBodyEvent, HTTPResponseStartEvent, Receive, Scope, Send

_PARAM = re.compile(r"\{([^}:]+)(?::([^}]+))?\}")


def _pattern(path: str) -> re.Pattern[str]:
    """`/v1/files/{file_id:str}` -> a regex matching `/v1/files/<one segment>` (`:path` spans segments)."""
    out, last = [], 0
    for match in _PARAM.finditer(path):
        out.append(re.escape(path[last : match.start()]))
        out.append(".*" if match.group(2) == "path" else "[^/]+")
        last = match.end()
    out.append(re.escape(path[last:]))
    return re.compile("^" + "".join(out) + "/?$")


def _table(app: Any) -> list[tuple[re.Pattern[str], str]]:
    table = getattr(app.state, "method_table", None)
    if table is None:
        routes = [r for r in app.routes if isinstance(r, HTTPRoute)]
        routes.sort(key=lambda r: len(_PARAM.findall(r.path)))  # literal paths before parametrised ones
        table = [(_pattern(r.path), ", ".join(sorted(r.methods))) for r in routes]
        app.state.method_table = table
    return table


def allowed_methods(app: Any, path: str) -> str:
    """The `Allow` value of a path ("" when no route has it)."""
    for pattern, methods in _table(app):
        if pattern.match(path):
            return methods
    return ""


class OptionsMiddleware(ASGIMiddleware):
    """Answers every OPTIONS request: 204 with `Allow` naming all methods of the path."""

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        if scope.get("method") != "OPTIONS":
            await next_app(scope, receive, send)
            return
        allow = allowed_methods(scope["app"], scope["path"])
        start: HTTPResponseStartEvent = {
            "type": "http.response.start",
            "status": 204,
            "headers": [(b"allow", allow.encode("ascii"))],
        }
        body: HTTPResponseBodyEvent = {"type": "http.response.body", "body": b"", "more_body": False}
        await send(start)
        await send(body)
