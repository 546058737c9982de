"""Liveness and readiness (open: they reveal nothing), and Prometheus metrics (behind a token).

Both answer 503 while the process drains (gateway/cluster/drain.py): `/health` with status `draining`,
`/ready` with the check `accepting` false.

`/metrics` carries tenant names and per-tenant token counters, so it needs
`Authorization: Bearer <token>` with `gateway.metrics_token` (for a Prometheus scrape job) or the
admin token; anything else gets 401.
"""

from __future__ import annotations

import asyncio

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

CHECK_TIMEOUT_S = 3.0  # under a probe's usual timeout, so /ready answers 503 rather than not at all


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
    checks = await readiness_checks(services)
    ok = all(checks.values())
    return Response(Readiness(ready=ok, checks=checks), status_code=200 if ok else 503)


async def readiness_checks(services: Services) -> dict[str, bool]:
    """What `/ready` answers, each check bounded by CHECK_TIMEOUT_S (a hung dependency fails it)."""
    checks: dict[str, bool] = {"accepting": not services.drain.draining}

    async def database() -> dict[str, bool]:
        async with services.session_factory() as session:
            await session.execute(text("SELECT 1"))
        return {"database": True}

    for name, check in (("database", database), ("shared", services.shared.ready),
                        ("backend", services.backend.ready)):
        try:
            checks.update(await asyncio.wait_for(check(), CHECK_TIMEOUT_S))
        except Exception:
            checks[name] = False
    return checks


@get(
    "/metrics",
    tags=["System"],
    summary="Prometheus metrics (bearer: metrics token or admin token)",
    media_type="text/plain",
    guards=[metrics_guard],
    security=METRICS_SECURITY,
    responses=error_responses(400, 401),
)
async def metrics(services: Injected[Services]) -> Response[bytes]:
    # The readiness checks as gauges, for the "Kafka / Redis / database unreachable" alerts: a
    # scrape (every 15-60 s) costs one check of each.
    telemetry.set_readiness(await readiness_checks(services))
    body, content_type = telemetry.metrics_payload()
    return Response(body, media_type=content_type)
