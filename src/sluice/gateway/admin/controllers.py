"""Admin API controllers (`Authorization: Bearer <admin token>`); logic lives in AdminService."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from litestar import Controller, Request, delete, get, patch, post
from litestar.params import FromQuery, JSONBody, QueryParameter

from sluice.gateway.admin import operations
from sluice.gateway.admin.schemas import (
    AuditList,
    KeyCreate,
    KeyCreated,
    KeyList,
    KeyOut,
    Quotas,
    QuotasPatch,
    TenantCreate,
    TenantDeleted,
    TenantList,
    TenantOut,
    TenantPatch,
    UsageList,
    usage_list,
)
from sluice.gateway.admin.service import AdminService
from sluice.gateway.auth.guards import admin_guard
from sluice.gateway.edge.errors import error_responses
from sluice.gateway.edge.openapi import ADMIN_SECURITY, IdPath, IdQuery
from sluice.gateway.quotas.usage import UsageService

# Every admin route: a malformed header or parameter, a missing or wrong token, a tenant key (403).
_READ = error_responses(400, 401, 403)
_BY_ID = error_responses(400, 401, 403, 404, notes={404: "Unknown tenant or key"})
_BODY = error_responses(400, 401, 403, 404, 413, notes={404: "Unknown tenant or key"})
_CREATE = error_responses(400, 401, 403, 409, 413, notes={409: "Another tenant has this name"})
_NAMED = error_responses(
    400, 401, 403, 404, 409, 413, notes={404: "Unknown tenant", 409: "Another tenant has this name"}
)

_WORKER = error_responses(400, 401, 403, 404, notes={400: "This backend has no workers to drain",
                                                     404: "No connected worker with this id"})
_BATCHES = error_responses(400, 401, 403, 404, notes={404: "The Batch API is not enabled"})
_BATCH = error_responses(400, 401, 403, 404, notes={400: "The batch has already ended",
                                                    404: "Unknown batch, or no Batch API"})


def _service(request: Request[Any, Any, Any]) -> AdminService:
    return request.app.state.admin


class AdminController(Controller):
    path = "/admin"
    tags = ["Admin"]  # noqa: RUF012
    guards = [admin_guard]  # noqa: RUF012
    security = ADMIN_SECURITY

    @post("/tenants", status_code=201, summary="Create a tenant (with its quotas)", responses=_CREATE)
    async def create_tenant(self, request: Request[Any, Any, Any], data: JSONBody[TenantCreate]) -> TenantOut:
        return await _service(request).create_tenant(data)

    @get("/tenants", summary="List tenants", responses=_READ)
    async def list_tenants(self, request: Request[Any, Any, Any]) -> TenantList:
        return TenantList(data=await _service(request).list_tenants())

    @get("/tenants/{tenant_id:str}", summary="Get a tenant", responses=_BY_ID)
    async def get_tenant(self, request: Request[Any, Any, Any], tenant_id: IdPath) -> TenantOut:
        return await _service(request).get_tenant(tenant_id)

    @patch(
        "/tenants/{tenant_id:str}", summary="Change a tenant (and optionally its quotas)", responses=_NAMED
    )
    async def update_tenant(
        self, request: Request[Any, Any, Any], tenant_id: IdPath, data: JSONBody[TenantPatch]
    ) -> TenantOut:
        return await _service(request).update_tenant(tenant_id, data)

    @delete(
        "/tenants/{tenant_id:str}",
        status_code=200,
        responses=_BY_ID,
        summary="Delete a tenant; one with usage history is disabled instead (the answer says which)",
    )
    async def delete_tenant(self, request: Request[Any, Any, Any], tenant_id: IdPath) -> TenantDeleted:
        return await _service(request).delete_tenant(tenant_id)

    @post(
        "/tenants/{tenant_id:str}/keys",
        status_code=201,
        responses=_BODY,
        summary="Create an API key; the only answer that shows the key",
    )
    async def create_key(
        self, request: Request[Any, Any, Any], tenant_id: IdPath, data: JSONBody[KeyCreate]
    ) -> KeyCreated:
        return await _service(request).create_key(tenant_id, data)

    @get("/tenants/{tenant_id:str}/keys", summary="List a tenant's keys (no secrets)", responses=_BY_ID)
    async def list_keys(self, request: Request[Any, Any, Any], tenant_id: IdPath) -> KeyList:
        return KeyList(data=await _service(request).list_keys(tenant_id))

    @delete(
        "/tenants/{tenant_id:str}/keys/{key_id:str}",
        status_code=200,
        summary="Revoke a key",
        responses=_BY_ID,
    )
    async def revoke_key(
        self, request: Request[Any, Any, Any], tenant_id: IdPath, key_id: IdPath
    ) -> KeyOut:
        return await _service(request).revoke_key(tenant_id, key_id)

    @post(
        "/tenants/{tenant_id:str}/keys/{key_id:str}/rotate",
        status_code=201,
        responses=_BY_ID,
        summary="Rotate a key: a new key is returned, the old one is revoked",
    )
    async def rotate_key(
        self, request: Request[Any, Any, Any], tenant_id: IdPath, key_id: IdPath
    ) -> KeyCreated:
        return await _service(request).rotate_key(tenant_id, key_id)

    @get("/tenants/{tenant_id:str}/quotas", summary="A tenant's quotas (null = unlimited)", responses=_BY_ID)
    async def get_quotas(self, request: Request[Any, Any, Any], tenant_id: IdPath) -> Quotas:
        return await _service(request).get_quotas(tenant_id)

    @patch(
        "/tenants/{tenant_id:str}/quotas",
        responses=_BODY,
        summary="Change quotas; applies to the next request (null = unlimited)",
    )
    async def update_quotas(
        self, request: Request[Any, Any, Any], tenant_id: IdPath, data: JSONBody[QuotasPatch]
    ) -> Quotas:
        return await _service(request).update_quotas(tenant_id, data)

    @get("/usage", summary="Token usage per tenant, model and UTC day", responses=_READ)
    async def usage(
        self,
        request: Request[Any, Any, Any],
        tenant_id: IdQuery = None,
        start: FromQuery[dt.date | None] = None,
        end: FromQuery[dt.date | None] = None,
    ) -> UsageList:
        usage: UsageService = request.app.state.usage
        rows = await usage.query(tenant_id, start, end)
        return usage_list(rows, start, end)

    @get("/queues", summary="Live queue view (from the generation backend)", responses=_READ)
    async def queues(self, request: Request[Any, Any, Any]) -> dict[str, Any]:
        snapshot = request.app.state.backend.snapshot()
        return {"queues": snapshot.get("queues", {})}

    @get("/workers", summary="Live worker view (from the generation backend)", responses=_READ)
    async def workers(self, request: Request[Any, Any, Any]) -> dict[str, Any]:
        snapshot = request.app.state.backend.snapshot()
        return {"workers": snapshot.get("workers", [])}

    @post("/workers/{worker_id:str}/drain", status_code=200, responses=_WORKER,
          summary="Drain a worker: it gets no new jobs and finishes its running ones")
    async def drain_worker(self, request: Request[Any, Any, Any], worker_id: IdPath) -> dict[str, Any]:
        return await operations.set_draining(request.app.state, worker_id, True)

    @post("/workers/{worker_id:str}/undrain", status_code=200, responses=_WORKER,
          summary="Put a drained worker back in service")
    async def undrain_worker(self, request: Request[Any, Any, Any], worker_id: IdPath) -> dict[str, Any]:
        return await operations.set_draining(request.app.state, worker_id, False)

    @get("/batches", summary="Every tenant's newest batches with their progress", responses=_BATCHES)
    async def batches(
        self, request: Request[Any, Any, Any], limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20
    ) -> dict[str, Any]:
        return {"object": "list", "data": await operations.recent_batches(request.app.state, limit)}

    @post("/batches/{batch_id:str}/cancel", status_code=200, summary="Cancel any tenant's batch",
          responses=_BATCH)
    async def cancel_batch(self, request: Request[Any, Any, Any], batch_id: IdPath) -> dict[str, Any]:
        return await operations.cancel_batch(request.app.state, batch_id)

    @get("/audit", summary="Audit log of admin mutations, newest first", responses=_READ)
    async def audit(
        self,
        request: Request[Any, Any, Any],
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
        target: IdQuery = None,
    ) -> AuditList:
        return AuditList(data=await _service(request).audit(limit, target))
