"""Console pages and live fragments (GET), and signing in and out.

Controllers stay thin: the data comes from gateway/queueing/snapshot.py (through `backend.snapshot()`), the
telemetry window, `AdminService` and the admin operations; `views.py` shapes it for templates.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Annotated, Any

from litestar import Controller, Request, get, post
from litestar.enums import RequestEncodingType
from litestar.params import Body, FromPath
from litestar.response import Redirect, Response, Template

from sluice.gateway.admin import operations
from sluice.gateway.admin.service import AdminService
from sluice.gateway.auth.guards import failed_admin_sign_in, source_address
from sluice.gateway.auth.service import AuthService
from sluice.gateway.console import views
from sluice.gateway.console.security import (
    LOGIN_COOKIE,
    SESSION_COOKIE,
    ConsoleSessions,
    cleared,
    console_guard,
    csrf_token,
    login_cookie,
    new_login_nonce,
    secure_cookies,
    session_cookie,
)
from sluice.gateway.db.models import QUOTA_FIELDS
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.services import services
from sluice.live_window import WINDOW
from sluice.protocol import Priority

ACTOR = "console"
REFRESH_S = 2  # the live page refreshes this often
Form = Annotated[dict[str, Any], Body(media_type=RequestEncodingType.URL_ENCODED)]
AnyRequest = Request[Any, Any, Any]


def render(request: AnyRequest, name: str, status_code: int = 200, headers: dict[str, str] | None = None,
           **context: Any) -> Template:
    """A console template with what every page needs: the CSRF token of this session."""
    session = getattr(request.state, "console_session", None)
    return Template(template_name=name, status_code=status_code, headers=headers, context={
        "csrf": csrf_token(session) if session else "",
        "refresh_s": REFRESH_S,
        "classes": [p.label for p in Priority],
        "quota_fields": QUOTA_FIELDS,
        **context,
    })


def admin_service(request: AnyRequest) -> AdminService:
    return services(request).admin


async def tenant_names(request: AnyRequest) -> dict[str, str]:
    return await admin_service(request).tenant_names()


async def live_context(request: AnyRequest) -> dict[str, Any]:
    async def recent_batches() -> list[dict[str, Any]] | None:
        try:
            return await operations.recent_batches(services(request), 20)
        except OpenAIError:
            return None  # the Batch API is not enabled here

    names, batches = await asyncio.gather(tenant_names(request), recent_batches())  # two sessions at once
    snapshot = services(request).backend.snapshot()
    class_rows, tenant_rows = views.queue_rows(snapshot, names, WINDOW)
    return {
        "class_rows": class_rows, "tenant_rows": tenant_rows,
        "workers": views.worker_rows(snapshot, WINDOW),
        "charts": views.tenant_charts(WINDOW),
        "slo_rows": views.slo_rows(WINDOW),
        "slo_percentile": services(request).settings.objectives.percentile,
        "horizon_min": round(WINDOW.horizon_s / 60), "bucket_s": round(WINDOW.bucket_s),
        "batches": batches, "names": names,
        "events": WINDOW.recent_events(30),
    }


class SignInController(Controller):
    path = "/"

    @get("/login", include_in_schema=False)
    async def login_form(self, request: AnyRequest) -> Template:
        nonce = new_login_nonce()
        page = render(request, "login.html.j2", nonce=nonce, error=None)
        page.cookies.append(login_cookie(nonce, secure=secure_cookies(request)))
        return page

    @post("/login", include_in_schema=False, status_code=303)
    async def login(self, request: AnyRequest, data: Form) -> Response[Any]:
        nonce = str(data.get("nonce", ""))
        expected = request.cookies.get(LOGIN_COOKIE, "")
        auth: AuthService = services(request).auth
        await auth.sign_ins.check(source_address(request))
        if not nonce or not expected or not hmac.compare_digest(nonce.encode(), expected.encode()):
            error, status = "The sign-in form expired; please try again.", 403
        elif not auth.verify_admin(str(data.get("token", "")).strip()):
            await failed_admin_sign_in(request, "console")
            error, status = "That is not a valid admin token.", 401
        else:
            sessions: ConsoleSessions = services(request).console_sessions
            value = await sessions.start()
            await admin_service(request).record("console.sign_in", "console", {}, ACTOR)
            return Redirect("/console", status_code=303, cookies=[
                session_cookie(value, secure=secure_cookies(request), max_age=int(sessions.ttl_s)),
                cleared(LOGIN_COOKIE),
            ])
        fresh = new_login_nonce()
        page = render(request, "login.html.j2", status_code=status, nonce=fresh, error=error)
        page.cookies.append(login_cookie(fresh, secure=secure_cookies(request)))
        return page


class PagesController(Controller):
    path = "/"
    guards = [console_guard]  # noqa: RUF012

    @post("/logout", include_in_schema=False, status_code=200)
    async def logout(self, request: AnyRequest) -> Response[Any]:
        sessions: ConsoleSessions = services(request).console_sessions
        await sessions.end(request.cookies.get(SESSION_COOKIE))
        await admin_service(request).record("console.sign_out", "console", {}, ACTOR)
        return Response(content="", headers={"HX-Redirect": "/console/login"},
                        cookies=[cleared(SESSION_COOKIE)])

    @post("/logout-everywhere", include_in_schema=False, status_code=200)
    async def logout_everywhere(self, request: AnyRequest) -> Response[Any]:
        """Ends every console session (every browser, every replica), this one included."""
        sessions: ConsoleSessions = services(request).console_sessions
        ended = await sessions.end_all()
        await admin_service(request).record("console.sign_out_everywhere", "console", {"sessions": ended}, ACTOR)
        return Response(content="", headers={"HX-Redirect": "/console/login"},
                        cookies=[cleared(SESSION_COOKIE)])

    @get("", include_in_schema=False)
    async def overview(self, request: AnyRequest) -> Template:
        return render(request, "overview.html.j2", nav="live", **await live_context(request))

    @get("/live", include_in_schema=False)
    async def live(self, request: AnyRequest) -> Template:
        """Every live section at once (htmx swaps each into its place, out of band): one request
        per refresh, one snapshot, one tenant-name lookup."""
        return render(request, "live.html.j2", **await live_context(request))

    @get("/tenants", include_in_schema=False)
    async def tenants(self, request: AnyRequest) -> Template:
        return render(request, "tenants.html.j2", nav="tenants",
                      tenants=await admin_service(request).list_tenants())

    @get("/tenants/{tenant_id:str}", include_in_schema=False)
    async def tenant(self, request: AnyRequest, tenant_id: FromPath[str]) -> Template:
        admin = admin_service(request)
        return render(request, "tenant.html.j2", nav="tenants", tenant=await admin.get_tenant(tenant_id),
                      keys=await admin.list_keys(tenant_id), created_key=None, flash=None,
                      audit=await admin.audit(20, tenant_id))
