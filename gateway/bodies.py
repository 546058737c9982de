"""JSON request bodies are decoded strictly, exactly as the OpenAPI document describes them.

Litestar 2 converts bodies with msgspec's lax mode (`strict=False`), which accepts `"5"` for an
integer and `0` for a boolean. This hook, run before each handler, decodes a JSON body with
msgspec's strict mode into the handler's body type, so a body the schema rejects is a 400 naming
the field; Litestar's own (lax) conversion then sees only bodies that already passed.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from litestar import Request
from litestar.enums import RequestEncodingType
from litestar.params import BodyKwarg

from sluice.gateway.errors import OpenAIError

_PATH = re.compile(r" - at `\$\.?([^`]*)`")
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def _json_body_type(request: Request[Any, Any, Any]) -> Any | None:
    field = request.route_handler.parsed_data_field
    if field is None:
        return None
    kwarg = field.kwarg_definition
    if isinstance(kwarg, BodyKwarg) and kwarg.media_type != RequestEncodingType.JSON:
        return None
    return field.annotation


def body_error(error: msgspec.ValidationError) -> OpenAIError:
    """msgspec's "Expected `int` >= 1 - at `$.max_tokens`" as a 400 with param `max_tokens`."""
    text = str(error)
    match = _PATH.search(text)
    if match is None or not match.group(1):
        return OpenAIError(400, f"Invalid request body: {text}.")
    param = match.group(1)
    return OpenAIError(400, f"Invalid `{param}` in the request body: {text[: match.start()]}.", param=param)


async def strict_json_body(request: Request[Any, Any, Any]) -> None:
    """Litestar `before_request` hook: raises the 400 for a JSON body its type rejects."""
    body_type = _json_body_type(request)
    if body_type is None:
        return
    raw = await request.body()
    if not raw.strip():
        raise OpenAIError(400, "The request needs a JSON body.")
    decoder = _decoders.get(body_type)
    if decoder is None:
        decoder = _decoders[body_type] = msgspec.json.Decoder(body_type)
    try:
        decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise body_error(exc) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"The request body is not valid JSON: {exc}.") from None
