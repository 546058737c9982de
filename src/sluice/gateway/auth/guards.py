"""The guards of tenant, admin and metrics routes: who may call a route, from its bearer token.

Each guard asks the `AuthService` (auth/service.py) of the app it guards (gateway/services.py); a tenant guard leaves
the caller's `TenantContext` on the connection for `current_tenant`, the tenant routes' dependency.
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from sluice import tracing
from sluice.gateway.auth.service import KEY_PREFIX, TenantContext, bearer_token, hash_secret
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.services import services


def _required_token(connection: ASGIConnection[Any, Any, Any, Any], missing: str, placeholder: str) -> str:
    """The bearer token; a 401 that says what to send when there is none."""
    token = bearer_token(connection)
    if token is None:
        raise OpenAIError(401, f"Missing {missing}: send `Authorization: Bearer <{placeholder}>`.",
                          type="invalid_request_error", code="missing_api_key")
    return token


async def tenant_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Authenticates a tenant key; stores the TenantContext on `connection.state.tenant`."""
    auth = services(connection).auth
    token = bearer_token(connection)
    # Whatever it looks like (SLUICE_ADMIN_TOKEN is free-form), the admin token gets a 403 that says so.
    if token is not None and not token.startswith(KEY_PREFIX) and auth.verify_admin(token):
        raise OpenAIError(
            403,
            "This is the admin token; tenant routes need a tenant API key (`sk-slc-...`).",
            type="permission_error",
            code="wrong_credentials",
        )
    with tracing.span("authenticate"):
        connection.state.tenant = await auth.authenticate(token)


def source_address(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The peer's address (behind a proxy: the proxy's, unless the server is told to trust it)."""
    client = connection.client
    return client.host if client is not None else "unknown"


async def failed_admin_sign_in(connection: ASGIConnection[Any, Any, Any, Any], via: str) -> None:
    """A wrong admin token: counted against its source (auth/attempts.py), logged, audited."""
    found = services(connection)
    source = source_address(connection)
    if await found.auth.sign_ins.failed(source, via):
        await found.admin.record("admin.sign_in_failed", via, {"source": source}, "anonymous")


async def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    auth = services(connection).auth
    token = _required_token(connection, "admin token", "admin token")
    await auth.sign_ins.check(source_address(connection))
    if not auth.verify_admin(token):
        if token.startswith(KEY_PREFIX):
            raise OpenAIError(
                403,
                "Tenant API keys cannot call admin routes.",
                type="permission_error",
                code="wrong_credentials",
            )
        await failed_admin_sign_in(connection, "admin API")
        raise OpenAIError(401, "Incorrect admin token.", type="invalid_request_error", code="invalid_api_key")


async def metrics_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """`/metrics`: the configured metrics token or the admin token, compared in constant time."""
    found = services(connection)
    auth = found.auth
    token = _required_token(connection, "token", "metrics token or admin token")
    configured = found.settings.gateway.metrics_token
    metrics_ok = bool(configured) and hmac.compare_digest(hash_secret(token), hash_secret(configured))
    if not (auth.verify_admin(token) or metrics_ok):
        raise OpenAIError(401, "Incorrect metrics token.", type="invalid_request_error", code="invalid_api_key")


def current_tenant(request: ASGIConnection[Any, Any, Any, Any]) -> TenantContext:
    """Dependency for tenant routes behind `tenant_guard` (the Batch API routes use it too)."""
    return request.state.tenant
