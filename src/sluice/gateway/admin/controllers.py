"""Admin API controllers (`Authorization: Bearer <admin token>`); logic lives in AdminService."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from litestar import Controller, delete, get, patch, post
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
from sluice.gateway.queueing.backend import GenerationBackend
from sluice.gateway.quotas.usage import UsageService
from sluice.gateway.services import Injected, Services

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


class AdminController(Controller):
    path = "/admin"
    tags = ["Admin"]  # noqa: RUF012
    guards = [admin_guard]  # noqa: RUF012
    security = ADMIN_SECURITY

    @post("/tenants", status_code=201, summary="Create a tenant (with its quotas)", responses=_CREATE)
    async def create_tenant(self, admin: Injected[AdminService], data: JSONBody[TenantCreate]) -> TenantOut:
        return await admin.create_tenant(data)

    @get("/tenants", summary="List tenants", responses=_READ)
    async def list_tenants(self, admin: Injected[AdminService]) -> TenantList:
        return TenantList(data=await admin.list_tenants())

    @get("/tenants/{tenant_id:str}", summary="Get a tenant", responses=_BY_ID)
    async def get_tenant(self, admin: Injected[AdminService], tenant_id: IdPath) -> TenantOut:
        return await admin.get_tenant(tenant_id)

    @patch(
        "/tenants/{tenant_id:str}", summary="Change a tenant (and optionally its quotas)", responses=_NAMED
    )
    async def update_tenant(
        self, admin: Injected[AdminService], tenant_id: IdPath, data: JSONBody[TenantPatch]
    ) -> TenantOut:
        return await admin.update_tenant(tenant_id, data)

    @delete(
        "/tenants/{tenant_id:str}",
        status_code=200,
        responses=_BY_ID,
        summary="Delete a tenant; one with usage history is disabled instead (the answer says which)",
    )
    async def delete_tenant(self, admin: Injected[AdminService], tenant_id: IdPath) -> TenantDeleted:
        return await admin.delete_tenant(tenant_id)

    @post(
        "/tenants/{tenant_id:str}/keys",
        status_code=201,
        responses=_BODY,
        summary="Create an API key; the only answer that shows the key",
    )
    async def create_key(
        self, admin: Injected[AdminService], tenant_id: IdPath, data: JSONBody[KeyCreate]
    ) -> KeyCreated:
        return await admin.create_key(tenant_id, data)

    @get("/tenants/{tenant_id:str}/keys", summary="List a tenant's keys (no secrets)", responses=_BY_ID)
    async def list_keys(self, admin: Injected[AdminService], tenant_id: IdPath) -> KeyList:
        return KeyList(data=await admin.list_keys(tenant_id))

    @delete(
        "/tenants/{tenant_id:str}/keys/{key_id:str}",
        status_code=200,
        summary="Revoke a key",
        responses=_BY_ID,
    )
    async def revoke_key(
        self, admin: Injected[AdminService], tenant_id: IdPath, key_id: IdPath
    ) -> KeyOut:
        return await admin.revoke_key(tenant_id, key_id)

    @post(
        "/tenants/{tenant_id:str}/keys/{key_id:str}/rotate",
        status_code=201,
        responses=_BY_ID,
        summary="Rotate a key: a new key is returned, the old one is revoked",
    )
    async def rotate_key(
        self, admin: Injected[AdminService], tenant_id: IdPath, key_id: IdPath
    ) -> KeyCreated:
        return await admin.rotate_key(tenant_id, key_id)

    @get("/tenants/{tenant_id:str}/quotas", summary="A tenant's quotas (null = unlimited)", responses=_BY_ID)
    async def get_quotas(self, admin: Injected[AdminService], tenant_id: IdPath) -> Quotas:
        return await admin.get_quotas(tenant_id)

    @patch(
        "/tenants/{tenant_id:str}/quotas",
        responses=_BODY,
        summary="Change quotas; applies to the next request (null = unlimited)",
    )
    async def update_quotas(
        self, admin: Injected[AdminService], tenant_id: IdPath, data: JSONBody[QuotasPatch]
    ) -> Quotas:
        return await admin.update_quotas(tenant_id, data)

    @get("/usage", summary="Token usage per tenant, model and UTC day", responses=_READ)
    async def usage(
        self,
        usage: Injected[UsageService],
        tenant_id: IdQuery = None,
        start: FromQuery[dt.date | None] = None,
        end: FromQuery[dt.date | None] = None,
    ) -> UsageList:
        rows = await usage.query(tenant_id, start, end)
        return usage_list(rows, start, end)

    @get("/queues", summary="Live queue view (from the generation backend)", responses=_READ)
    async def queues(self, backend: Injected[GenerationBackend]) -> dict[str, Any]:
        snapshot = backend.snapshot()
        return {"queues": snapshot.get("queues", {})}

    @get("/workers", summary="Live worker view (from the generation backend)", responses=_READ)
    async def workers(self, backend: Injected[GenerationBackend]) -> dict[str, Any]:
        snapshot = backend.snapshot()
        return {"workers": snapshot.get("workers", [])}

    @post("/workers/{worker_id:str}/drain", status_code=200, responses=_WORKER,
          summary="Drain a worker: it gets no new jobs and finishes its running ones")
    async def drain_worker(self, services: Injected[Services], worker_id: IdPath) -> dict[str, Any]:
        return await operations.set_draining(services, worker_id, True)

    @post("/workers/{worker_id:str}/undrain", status_code=200, responses=_WORKER,
          summary="Put a drained worker back in service")
    async def undrain_worker(self, services: Injected[Services], worker_id: IdPath) -> dict[str, Any]:
        return await operations.set_draining(services, worker_id, False)

    @get("/batches", summary="Every tenant's newest batches with their progress", responses=_BATCHES)
    async def batches(
        self, services: Injected[Services], limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20
    ) -> dict[str, Any]:
        return {"object": "list", "data": await operations.recent_batches(services, limit)}

    @post("/batches/{batch_id:str}/cancel", status_code=200, summary="Cancel any tenant's batch",
          responses=_BATCH)
    async def cancel_batch(self, services: Injected[Services], batch_id: IdPath) -> dict[str, Any]:
        return await operations.cancel_batch(services, batch_id)

    @get("/audit", summary="Audit log of admin mutations, newest first", responses=_READ)
    async def audit(
        self,
        admin: Injected[AdminService],
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
        target: IdQuery = None,
    ) -> AuditList:
        return AuditList(data=await admin.audit(limit, target))
