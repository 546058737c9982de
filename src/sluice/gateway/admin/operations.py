"""Admin operations on the running system (not on the tenant tables): drain a worker, cancel a batch.

The admin API and the console both call these, and each is written to the audit log through
`AdminService.record`, like every tenant, key and quota change.
"""

from __future__ import annotations

from typing import Any

from sluice.gateway.admin.service import ADMIN_ACTOR, AdminService
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.services import Services


def _dispatcher(services: Services) -> Any:
    dispatcher = getattr(services.backend, "dispatcher", None)
    if dispatcher is None:
        raise OpenAIError(400, "This gateway's backend has no worker registry to drain.", code="not_supported")
    return dispatcher


def _batches(services: Services) -> Any:
    batches = services.batches
    if batches is None:
        raise OpenAIError(404, "The Batch API is not enabled on this gateway.", code="not_found")
    return batches


async def set_draining(services: Services, worker_id: str, draining: bool, actor: str = ADMIN_ACTOR) -> dict[str, Any]:
    """Drain (no new jobs; running ones finish) or put a worker back in service."""
    dispatcher = _dispatcher(services)
    if worker_id not in dispatcher.workers and worker_id not in dispatcher.draining:
        raise OpenAIError(404, f"No connected worker with id {worker_id!r}.", code="worker_not_found")
    changed = dispatcher.drain(worker_id) if draining else dispatcher.undrain(worker_id)
    if changed:
        admin: AdminService = services.admin
        await admin.record("worker.drain" if draining else "worker.undrain", worker_id, {}, actor)
    return {"worker_id": worker_id, "draining": draining}


async def recent_batches(services: Services, limit: int = 20) -> list[dict[str, Any]]:
    return list(await _batches(services).recent_batches(limit))


async def cancel_batch(services: Services, batch_id: str, actor: str = ADMIN_ACTOR) -> dict[str, Any]:
    batches = _batches(services)
    tenant_id = await batches.tenant_of(batch_id)
    view: dict[str, Any] = await batches.cancel_batch(tenant_id, batch_id)
    admin: AdminService = services.admin
    await admin.record("batch.cancel", tenant_id, {"batch_id": batch_id, "status": view["status"]}, actor)
    return view
