"""Liveness and readiness (open: they reveal nothing), and Prometheus metrics (behind a token).

Both answer 503 while the process drains (gateway/cluster/drain.py): `/health` with status `draining`,
`/ready` with the check `accepting` false.

`/metrics` carries tenant names and per-tenant token counters, so it needs
`Authorization: Bearer <token>` with `gateway.metrics_token` (for a Prometheus scrape job) or the
admin token; anything else gets 401.
"""

from __future__ import annotations

import msgspec
from litestar import Response, get
from litestar.openapi import ResponseSpec
from sqlalchemy import text

from sluice import telemetry
from sluice.gateway.auth.guards import metrics_guard
from sluice.gateway.cluster.drain import Drain
from sluice.gateway.edge.errors import error_responses
from sluice.gateway.edge.openapi import METRICS_SECURITY
from sluice.gateway.services import Injected, Services


class Health(msgspec.Struct):
    status: str


class Readiness(msgspec.Struct):
    ready: bool
    checks: dict[str, bool]


@get(
    "/health",
    tags=["System"],
    summary="Liveness: the process answers (503 `draining` once SIGTERM began its drain)",
    responses={503: ResponseSpec(Health, description="Draining: stopping, takes no new requests")},
)
async def health(drain: Injected[Drain]) -> Response[Health]:
    # A load balancer's health check moves traffic away from a draining replica before it exits.
    if drain.draining:
        return Response(Health(status="draining"), status_code=503)
    return Response(Health(status="ok"))


@get(
    "/ready",
    tags=["System"],
    summary="Readiness: database, shared store (when configured) and backend (200, else 503 with details)",
    responses={503: ResponseSpec(Readiness, description="Not ready: `checks` says what is missing")},
)
async def ready(services: Injected[Services]) -> Response[Readiness]:
    checks: dict[str, bool] = {"accepting": not services.drain.draining}
    try:
        async with services.session_factory() as session:
            await session.execute(text("SELECT 1"))
        checks["database"] = True
    except Exception:
        checks["database"] = False
    checks.update(await services.shared.ready())
    try:
        checks.update(await services.backend.ready())
    except Exception:
        checks["backend"] = False
    ok = all(checks.values())
    return Response(Readiness(ready=ok, checks=checks), status_code=200 if ok else 503)


@get(
    "/metrics",
    tags=["System"],
    summary="Prometheus metrics (bearer: metrics token or admin token)",
    media_type="text/plain",
    guards=[metrics_guard],
    security=METRICS_SECURITY,
    responses=error_responses(400, 401),
)
async def metrics() -> Response[bytes]:
    body, content_type = telemetry.metrics_payload()
    return Response(body, media_type=content_type)
