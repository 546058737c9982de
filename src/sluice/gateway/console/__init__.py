"""The admin web console at /console: live queues, workers, latency charts, batches; tenant and key admin.

Server-rendered Jinja2 templates (autoescaped) with htmx (vendored in static/, no Node.js at
install or run time) polling small fragments; charts are inline SVG drawn on the server. Sign-in,
sessions, CSRF and the Content-Security-Policy are in `security.py`; every action goes through
the admin API's services and is audited (`actions.py`).

`create_app` adds `console_route_handlers()` and `template_config()`, and keeps a
`security.ConsoleSessions` (gateway/services.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from litestar import Request, Response, Router
from litestar.datastructures import CacheControlHeader
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig

from sluice.gateway.console.security import SignInRequired, security_headers

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
TEMPLATE_DIR = HERE / "templates"


def _sign_in_required(request: Request[Any, Any, Any], _: SignInRequired) -> Response[Any]:
    if request.headers.get("hx-request") == "true":  # a fragment poll or an action: the page moves
        return Response(content="Sign in again.", status_code=401, media_type="text/plain",
                        headers={"HX-Redirect": "/console/login"})
    return Redirect("/console/login", status_code=303)


def _filters(engine: JinjaTemplateEngine) -> None:
    def seconds(value: float | None) -> str:
        if value is None:
            return "–"
        if value < 1:
            return f"{value * 1000:.0f} ms"
        if value < 120:
            return f"{value:.1f} s"
        return f"{value / 60:.0f} min"

    def timestamp(value: float) -> str:
        return time.strftime("%H:%M:%S", time.gmtime(value))

    engine.engine.filters["seconds"] = seconds
    engine.engine.filters["timestamp"] = timestamp


def template_config() -> TemplateConfig[JinjaTemplateEngine]:
    return TemplateConfig(directory=TEMPLATE_DIR, engine=JinjaTemplateEngine, engine_callback=_filters)


def console_route_handlers() -> list[Any]:
    from sluice.gateway.console.actions import ActionsController
    from sluice.gateway.console.pages import PagesController, SignInController

    pages = Router(
        path="/console",
        route_handlers=[SignInController, PagesController, ActionsController],
        middleware=[security_headers],
        exception_handlers={SignInRequired: _sign_in_required},
        include_in_schema=False,
    )
    static = create_static_files_router(
        path="/console/static", directories=[STATIC_DIR], middleware=[security_headers],
        cache_control=CacheControlHeader(max_age=3600), name="console-static",
    )
    return [pages, static]
