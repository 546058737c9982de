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
from redis.exceptions import RedisError

from sluice import telemetry
from sluice.gateway.edge.body_decode import NESTED_TOO_DEEPLY, BodyFault
from sluice.gateway.edge.methods import allowed_methods

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
    param: str | None  # the body field, query parameter or header at fault, when one is
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Documented error body of every route."""

    error: ErrorDetail


# What each error status means on this API; a route documents the statuses it can answer.
ERROR_MEANINGS: dict[int, str] = {
    400: "Invalid request: a body field, query parameter or header is malformed or out of range "
    "(`param` names it), or the request cannot be served as asked",
    401: "Missing or invalid credentials (`Authorization: Bearer <key>`)",
    403: "The credentials are valid but not for this: wrong kind of credential, a disabled tenant, "
    "or a model the tenant may not use",
    404: "No such resource (unknown id or model)",
    409: "The name is already taken",
    410: "Gone: the stream events asked for are no longer kept (past the log's bound)",
    413: "The request body is larger than the gateway accepts",
    422: "An Idempotency-Key reused with another request (body or endpoint) than it was first sent with",
    429: "Over a rate limit (`retry-after` says when to retry) or over a budget that no retry helps "
    "(`x-should-retry: false`): the daily token budget, or one request larger than the tokens-per-minute "
    "limit",
    503: "Temporarily unable to take the request (starting, no worker, or the request queue is "
    "unavailable); retry later",
}


def error_responses(*statuses: int, notes: dict[int, str] | None = None) -> dict[int, ResponseSpec]:
    """A route's documented error answers: each status with the OpenAI error body and its meaning."""
    notes = notes or {}
    return {
        status: ResponseSpec(
            data_container=ErrorResponse,
            description=ERROR_MEANINGS[status] + (f". {notes[status]}" if status in notes else ""),
            generate_examples=False,
        )
        for status in statuses
    }


def service_unavailable(what: str = "this request") -> OpenAIError:
    """503 without internals: the reason (a broker address, a worker) goes to the operator's log."""
    return OpenAIError(
        503,
        f"The service cannot take {what} right now; try again shortly.",
        type="server_error",
        code="service_unavailable",
        headers={"retry-after": "1"},
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def body_fault(fault: BodyFault) -> OpenAIError:
    return bad_request(fault.message, fault.param, fault.code)


_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}
_PATH_RE = re.compile(r"`\$\.([A-Za-z0-9_\.\[\]]+)`")


def _param_from(message: str) -> str | None:
    match = _PATH_RE.search(message)
    return match.group(1) if match else None


def _rate_headers(request: Request[Any, Any, Any]) -> dict[str, str]:
    tenant = request.scope.get("state", {}).get("tenant")
    found = request.app.state.get("services")  # absent in an app without sluice's services (tests)
    if tenant is None or found is None:
        return {}
    return dict(found.quotas.headers(tenant))


def _respond(request: Request[Any, Any, Any], error: OpenAIError) -> Response[Any]:
    telemetry.count_error_response(error.status)  # every error answer passes here (the 5xx alert)
    headers = {**_rate_headers(request), **error.headers}
    return Response(
        content=error.body(), status_code=error.status, headers=headers, media_type="application/json"
    )


def openai_error_handler(request: Request[Any, Any, Any], exc: OpenAIError) -> Response[Any]:
    return _respond(request, exc)


_SOURCES = {"query": "query parameter", "path": "path parameter", "header": "header", "cookie": "cookie"}


def validation_error_handler(request: Request[Any, Any, Any], exc: ValidationException) -> Response[Any]:
    """A field Litestar (msgspec) rejected: the message names where it was (body, query, path, header)."""
    detail = str(exc.detail or "invalid request")
    extra = exc.extra
    first = extra[0] if isinstance(extra, list) and extra and isinstance(extra[0], dict) else {}
    key = first.get("key")
    param = key if isinstance(key, str) and key else _param_from(detail)
    raw_source = first.get("source") or "body"
    source = str(getattr(raw_source, "value", raw_source))  # Litestar's ParamType enum, or "body"
    reason = str(first.get("message") or detail)
    if source == "body" and param == "data":  # no body at all, or not the expected kind
        if request.headers.get("content-type", "").startswith("multipart/"):
            message, param = "The upload needs the form fields `file` (a JSONL file) and `purpose`.", "file"
        else:
            message, param = "The request needs a JSON body.", None
    elif source in _SOURCES:
        message = f"Invalid {_SOURCES[source]} `{param}`: {reason}."
    elif param:
        message = f"Invalid `{param}` in the request body: {reason}."
    else:
        message = f"Invalid request body: {_clean(reason)}."
    return _respond(request, OpenAIError(400, message, param=param))


def method_not_allowed(request: Request[Any, Any, Any]) -> OpenAIError:
    """405 with `Allow` (RFC 9110 requires it), listing every method the path has."""
    allow = allowed_methods(request.app, request.url.path)
    return OpenAIError(
        405,
        f"Method {request.method} is not allowed on {request.url.path}; allowed: {allow}.",
        code="method_not_allowed",
        headers={"allow": allow} if allow else None,
    )


def http_error_handler(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    message = str(exc.detail or "error")
    code: str | None = None
    param: str | None = None
    if status == 400 and message == "Request Entity Too Large":
        # Litestar's multipart parser: a part header over 4 KB (in practice a long file name) or
        # too many parts. It is neither about the body size nor a 413.
        message = (
            "The multipart form could not be read: a part header is longer than 4 KB (a file name "
            "may have at most 255 characters) or the form has too many parts."
        )
        param, code = "file", "invalid_multipart"
    elif status == 404:
        message, code = f"Unknown route {request.method} {request.url.path}.", "not_found"
    elif status == 405:
        return _respond(request, method_not_allowed(request))
    elif status == 413:
        message, code = "Request body too large.", "request_too_large"
    elif isinstance(exc, NotAuthorizedException):
        code = "invalid_api_key"
    error = OpenAIError(
        status,
        message,
        type=_TYPES.get(status, "invalid_request_error"),
        param=param,
        code=code,
        headers=dict(exc.headers or {}),
    )
    return _respond(request, error)


def recursion_error_handler(request: Request[Any, Any, Any], exc: RecursionError) -> Response[Any]:
    """JSON nested deeper than the decoder's recursion limit (about 1,000 levels) is bad input."""
    text = str(exc)
    if "deserializing" in text or "decoding" in text:
        return _respond(request, OpenAIError(400, NESTED_TOO_DEEPLY, code="json_too_deep"))
    return internal_error_handler(request, exc)


def shared_store_error_handler(request: Request[Any, Any, Any], exc: RedisError) -> Response[Any]:
    """The shared store (Redis) failed on a path that has no more specific answer (e.g. filing a
    stream in the stream log): a 503 the client may retry; the reason goes to the operator's log."""
    log.warning("shared store unavailable on %s %s: %r", request.method, request.url.path, exc)
    return _respond(request, service_unavailable())


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
    RecursionError: recursion_error_handler,
    ValidationException: validation_error_handler,
    HTTPException: http_error_handler,
    RedisError: shared_store_error_handler,
    Exception: internal_error_handler,
}
