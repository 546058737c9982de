"""Live views for the admin API (`/admin/queues`, `/admin/workers`): `backend.snapshot()`.

Plain JSON-able dicts: queue depth per class and tenant with the oldest wait (the in-memory
scheduler), what runs per class and per tenant, what the Kafka consumers hold, and every connected
worker's capacity, load and draining mark.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from sluice.protocol import Priority

if TYPE_CHECKING:
    from sluice.gateway.queueing.acceptance import KafkaBackend


def backend_snapshot(backend: KafkaBackend) -> dict[str, Any]:
    dispatcher = backend.dispatcher
    queues = dispatcher.scheduler.snapshot(time.time())
    running: dict[str, int] = dict.fromkeys((p.label for p in Priority), 0)
    running_tenants: dict[str, int] = {}
    for worker in dispatcher.workers.values():
        for job in worker.inflight.values():
            running[job.request.priority.label] += 1
            running_tenants[job.request.tenant_id] = running_tenants.get(job.request.tenant_id, 0) + 1
    consumers = {
        p.label: {"paused": c.paused, "unfinished_offsets": c.num_unfinished}
        for p, c in backend._consumers.items()
    }
    return {
        "queues": {
            "backend": "kafka",
            "priority_enabled": queues["priority_enabled"],
            "classes": queues["classes"],
            "running": running,
            "running_tenants": running_tenants,
            "consumers": consumers,
            "jobs": dispatcher.num_jobs,
            "replayed_orphans": backend.replayed_orphans,
            # Replica takeover (docs/streams.md): stream records held here, streams this replica took over.
            "held_streams": backend.holder.held if backend.holder is not None else 0,
            "streams_taken_over": backend.holder.taken_over if backend.holder is not None else 0,
            "deferred_batch_lines": backend.batch_lines.deferred if backend.batch_lines is not None else 0,
        },
        "workers": dispatcher.workers_view(),
    }
