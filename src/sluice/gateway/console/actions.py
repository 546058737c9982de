"""Console actions (POST, behind the session guard and its CSRF check).

Each one calls the service the admin API calls (`AdminService`, gateway/admin/operations.py) with
the actor "console", so it is written to the audit log the same way, and answers the page section
it changed. A refused action (bad field, unknown id, name taken) answers its error in the page's
flash area (`HX-Retarget`), with the admin API's status code and message.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Controller, post
from litestar.params import FromPath
from litestar.response import Response, Template

from sluice.gateway.admin import operations
from sluice.gateway.admin.schemas import TenantPatch
from sluice.gateway.admin.service import AdminService
from sluice.gateway.console import forms, views
from sluice.gateway.console.pages import ACTOR, AnyRequest, Form, admin_service, render, tenant_names
from sluice.gateway.console.security import console_guard
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.services import services
from sluice.live_window import WINDOW


def refused(request: AnyRequest, error: OpenAIError) -> Template:
    return render(request, "partials/flash.html.j2", status_code=error.status,
                  headers={"HX-Retarget": "#flash", "HX-Reswap": "innerHTML"},
                  kind="error", message=error.message, param=error.param)


async def tenant_section(request: AnyRequest, tenant_id: str, flash: str | None = None,
                         created_key: Any = None) -> Template:
    """The whole tenant panel (settings, quotas, keys) after a change."""
    admin = admin_service(request)
    return render(request, "partials/tenant_panel.html.j2", tenant=await admin.get_tenant(tenant_id),
                  keys=await admin.list_keys(tenant_id), created_key=created_key, flash=flash,
                  audit=await admin.audit(20, tenant_id))


async def change_tenant(request: AnyRequest, tenant_id: str, change: Callable[[AdminService], Awaitable[Any]], *,
                        flash: str | Callable[[Any], str] | None = None, shows_key: bool = False) -> Template:
    """Runs `change` (form parsing included, so a bad field is refused too) and answers the tenant
    panel with `flash` (a message, or one made from the change's result) or, with `shows_key`, the
    key the change created shown once."""
    try:
        result = await change(admin_service(request))
    except OpenAIError as exc:
        return refused(request, exc)
    message = flash(result) if callable(flash) else flash
    return await tenant_section(request, tenant_id, flash=message, created_key=result if shows_key else None)


class ActionsController(Controller):
    path = "/"
    guards = [console_guard]  # noqa: RUF012

    @post("/tenants", include_in_schema=False, status_code=200)
    async def create_tenant(self, request: AnyRequest, data: Form) -> Response[Any] | Template:
        try:
            tenant = await admin_service(request).create_tenant(forms.tenant_create(data), actor=ACTOR)
        except OpenAIError as exc:
            return refused(request, exc)
        return Response(content="", headers={"HX-Redirect": f"/console/tenants/{tenant.id}"})

    @post("/tenants/{tenant_id:str}", include_in_schema=False, status_code=200)
    async def update_tenant(self, request: AnyRequest, tenant_id: FromPath[str], data: Form) -> Template:
        return await change_tenant(
            request, tenant_id, lambda admin: admin.update_tenant(tenant_id, forms.tenant_patch(data), actor=ACTOR),
            flash="Settings saved.")

    @post("/tenants/{tenant_id:str}/enabled", include_in_schema=False, status_code=200)
    async def set_enabled(self, request: AnyRequest, tenant_id: FromPath[str], data: Form) -> Template:
        enabled = data.get("enabled") == "true"
        return await change_tenant(
            request, tenant_id, lambda admin: admin.update_tenant(tenant_id, TenantPatch(enabled=enabled), actor=ACTOR),
            flash="Tenant enabled." if enabled else "Tenant disabled: its keys no longer work.")

    @post("/tenants/{tenant_id:str}/quotas", include_in_schema=False, status_code=200)
    async def update_quotas(self, request: AnyRequest, tenant_id: FromPath[str], data: Form) -> Template:
        return await change_tenant(
            request, tenant_id, lambda admin: admin.update_quotas(tenant_id, forms.quotas_patch(data), actor=ACTOR),
            flash="Quotas saved.")

    @post("/tenants/{tenant_id:str}/keys", include_in_schema=False, status_code=200)
    async def create_key(self, request: AnyRequest, tenant_id: FromPath[str], data: Form) -> Template:
        return await change_tenant(
            request, tenant_id, lambda admin: admin.create_key(tenant_id, forms.key_create(data), actor=ACTOR),
            shows_key=True)

    @post("/tenants/{tenant_id:str}/keys/{key_id:str}/revoke", include_in_schema=False, status_code=200)
    async def revoke_key(self, request: AnyRequest, tenant_id: FromPath[str], key_id: FromPath[str]) -> Template:
        return await change_tenant(
            request, tenant_id, lambda admin: admin.revoke_key(tenant_id, key_id, actor=ACTOR),
            flash=lambda key: f"Key {key.prefix}… revoked.")

    @post("/tenants/{tenant_id:str}/keys/{key_id:str}/rotate", include_in_schema=False, status_code=200)
    async def rotate_key(self, request: AnyRequest, tenant_id: FromPath[str], key_id: FromPath[str]) -> Template:
        return await change_tenant(
            request, tenant_id, lambda admin: admin.rotate_key(tenant_id, key_id, actor=ACTOR), shows_key=True)

    @post("/workers/{worker_id:str}/drain", include_in_schema=False, status_code=200)
    async def drain(self, request: AnyRequest, worker_id: FromPath[str]) -> Template:
        return await self._set_draining(request, worker_id, True)

    @post("/workers/{worker_id:str}/undrain", include_in_schema=False, status_code=200)
    async def undrain(self, request: AnyRequest, worker_id: FromPath[str]) -> Template:
        return await self._set_draining(request, worker_id, False)

    async def _set_draining(self, request: AnyRequest, worker_id: str, draining: bool) -> Template:
        try:
            await operations.set_draining(services(request), worker_id, draining, actor=ACTOR)
        except OpenAIError as exc:
            return refused(request, exc)
        rows = views.worker_rows(services(request).backend.snapshot(), WINDOW)
        return render(request, "live/workers.html.j2", workers=rows)

    @post("/batches/{batch_id:str}/cancel", include_in_schema=False, status_code=200)
    async def cancel_batch(self, request: AnyRequest, batch_id: FromPath[str]) -> Template:
        try:
            await operations.cancel_batch(services(request), batch_id, actor=ACTOR)
            batches = await operations.recent_batches(services(request), 20)
        except OpenAIError as exc:
            return refused(request, exc)
        return render(request, "live/batches.html.j2", batches=batches, names=await tenant_names(request))
