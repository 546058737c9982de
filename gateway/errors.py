"""OpenAI-style error objects and the exception handlers that produce them.

Every error the gateway answers has the body `{"error": {"message", "type", "param", "code"}}`.
Bad input never becomes a 500: Litestar's validation errors, msgspec decode errors, oversized
bodies and unknown routes or methods are all mapped here. Authenticated answers also carry the
tenant's `x-ratelimit-*` headers (see `QuotaService.headers`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, NotAuthorizedException, ValidationException
from litestar.openapi import ResponseSpec
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR

log = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """Documented error body of every route."""

    error: ErrorDetail


def error_responses(descriptions: dict[int, str]) -> dict[int, ResponseSpec]:
    """A controller's documented error answers: each status with the error body and its meaning."""
    return {
        status: ResponseSpec(data_container=ErrorResponse, description=text)
        for status, text in descriptions.items()
    }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}
_PATH_RE = re.compile(r"`\$\.([A-Za-z0-9_\.\[\]]+)`")


def _param_from(message: str) -> str | None:
    match = _PATH_RE.search(message)
    return match.group(1) if match else None


def _rate_headers(request: Request[Any, Any, Any]) -> dict[str, str]:
    tenant = request.scope.get("state", {}).get("tenant")
    quotas = getattr(request.app.state, "quotas", None)
    if tenant is None or quotas is None:
        return {}
    return quotas.headers(tenant)


def _respond(request: Request[Any, Any, Any], error: OpenAIError) -> Response[Any]:
    headers = {**_rate_headers(request), **error.headers}
    return Response(
        content=error.body(), status_code=error.status, headers=headers, media_type="application/json"
    )


def openai_error_handler(request: Request[Any, Any, Any], exc: OpenAIError) -> Response[Any]:
    return _respond(request, exc)


def validation_error_handler(request: Request[Any, Any, Any], exc: ValidationException) -> Response[Any]:
    # Litestar wraps msgspec's decode error; its text names the JSON path, e.g. `$.max_tokens`.
    detail = str(exc.detail or "invalid request body")
    extra = exc.extra
    if isinstance(extra, list) and extra and isinstance(extra[0], dict):
        detail = str(extra[0].get("message") or detail)
        key = extra[0].get("key")
        param = key if isinstance(key, str) and key else _param_from(detail)
    else:
        param = _param_from(detail)
    if "Expected" not in detail and "JSON" not in detail and "Object" not in detail:
        detail = f"Invalid request body: {detail}"
    return _respond(request, OpenAIError(400, _clean(detail), param=param))


def http_error_handler(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    message = str(exc.detail or "error")
    code: str | None = None
    if status == 404:
        message, code = f"Unknown route {request.method} {request.url.path}.", "not_found"
    elif status == 405:
        message, code = f"Method {request.method} is not allowed on {request.url.path}.", "method_not_allowed"
    elif status == 413:
        message, code = "Request body too large.", "request_too_large"
    elif isinstance(exc, NotAuthorizedException):
        code = "invalid_api_key"
    error = OpenAIError(
        status,
        message,
        type=_TYPES.get(status, "invalid_request_error"),
        code=code,
        headers=dict(exc.headers or {}),
    )
    return _respond(request, error)


def internal_error_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    log.error(
        "unhandled error on %s %s: %s", request.method, request.url.path, type(exc).__name__, exc_info=exc
    )
    error = OpenAIError(
        HTTP_500_INTERNAL_SERVER_ERROR, "The server had an error processing the request.", type="server_error"
    )
    return _respond(request, error)


def _clean(message: str) -> str:
    # Litestar prefixes some messages with the status line; keep the user-facing part.
    return message.replace("400: ", "", 1).strip()


EXCEPTION_HANDLERS: dict[type[Exception] | int, Any] = {
    OpenAIError: openai_error_handler,
    ValidationException: validation_error_handler,
    HTTPException: http_error_handler,
    Exception: internal_error_handler,
}
