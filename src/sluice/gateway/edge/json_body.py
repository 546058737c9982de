"""JSON request bodies are decoded strictly, exactly as the OpenAPI document describes them, once.

Litestar 2 converts bodies with msgspec's lax mode (`strict=False`), which accepts `"5"` for an
integer and `0` for a boolean. This hook, run before each handler, decodes a JSON body with
msgspec's strict mode into the handler's body type, so a body the schema rejects is a 400 naming
the field. The decoded body is left in Litestar's request state, so Litestar does not decode it a
second time (it takes a struct of the right type as it is).

A dense body (one that may hold many JSON values) is judged in a helper process first
(`body_decode.py`, which imports no web framework so that process stays small): decoding it here
would hold the event loop for as long as it takes.
"""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.enums import RequestEncodingType
from litestar.params import BodyKwarg
from litestar.utils.scope.state import ScopeState

from sluice.gateway.edge.body_decode import InvalidBody, decode, is_dense
from sluice.gateway.edge.errors import OpenAIError, body_fault
from sluice.gateway.services import services


def _json_body_type(request: Request[Any, Any, Any]) -> Any | None:
    field = request.route_handler.parsed_data_field
    if field is None:
        return None
    kwarg = field.kwarg_definition
    if isinstance(kwarg, BodyKwarg) and kwarg.media_type != RequestEncodingType.JSON:
        return None
    return field.annotation


async def strict_json_body(request: Request[Any, Any, Any]) -> None:
    """Litestar `before_request` hook: raises the 400 for a JSON body its type rejects."""
    body_type = _json_body_type(request)
    if body_type is None:
        return
    raw = await request.body()
    if not raw.strip():
        raise OpenAIError(400, "The request needs a JSON body.")
    if is_dense(raw):
        found = services(request)
        fault = await found.body_judge.judge(raw, body_type, found.generation.limits)
        if fault is not None:
            raise body_fault(fault)
    try:
        body = decode(raw, body_type)
    except InvalidBody as exc:
        raise body_fault(exc.fault) from None
    ScopeState.from_scope(request.scope).json = body
