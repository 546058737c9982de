"""The served OpenAPI document (`/schema/openapi.json`), exact about what the server validates.

Litestar builds the document from the route handlers: paths, parameters, the responses each
route declares and its security. The JSON Schemas of the msgspec bodies are then replaced by
the ones msgspec derives from the same types it validates with (`msgspec.json.schema_components`),
so every bound, enum and pattern in the document is the one enforced. (Litestar 2 drops bounds
equal to zero, e.g. `weight > 0` or `temperature >= 0`.)
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from typing import Annotated, Any

import msgspec
from litestar import Request
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from litestar.params import Parameter
from litestar.routes import HTTPRoute

from sluice.gateway.edge.schemas import TOKEN_ID_MARK
from sluice.gateway.services import services

REF_TEMPLATE = "#/components/schemas/{name}"
# The shape of every id we hand out (`file_…`, `batch_…`, `ten_…`, `key_…`), for path and `after`
# parameters: anything else is a 400 before it reaches a database (PostgreSQL rejects NUL bytes).
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
IdPath = Annotated[str, Parameter(pattern=ID_PATTERN, max_length=64)]
IdQuery = Annotated[str | None, Parameter(pattern=ID_PATTERN, max_length=64)]
TENANT_SECURITY: list[dict[str, list[str]]] = [{"apiKey": []}]
ADMIN_SECURITY: list[dict[str, list[str]]] = [{"adminToken": []}]
METRICS_SECURITY: list[dict[str, list[str]]] = [{"metricsToken": []}, {"adminToken": []}]
COMPONENTS = Components(
    security_schemes={
        "apiKey": SecurityScheme(
            type="http", scheme="bearer", description="A tenant API key (`sk-slc-...`)"
        ),
        "adminToken": SecurityScheme(
            type="http", scheme="bearer", description="The admin token (`SLUICE_ADMIN_TOKEN`)"
        ),
        "metricsToken": SecurityScheme(
            type="http", scheme="bearer", description="The metrics token (`gateway.metrics_token`)"
        ),
    }
)


def _structs(annotation: Any) -> Iterable[type[msgspec.Struct]]:
    """The msgspec Struct types inside an annotation (through Annotated, unions, Response[...])."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from _structs(arg)


def body_types(app: Any) -> set[type[msgspec.Struct]]:
    """Every Struct a route takes as its body, returns, or documents as an extra response."""
    found: set[type[msgspec.Struct]] = set()
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for handler in route.route_handlers:
            try:
                hints = typing.get_type_hints(handler.fn, include_extras=True)
            except Exception:  # a handler Litestar made itself (OPTIONS), without resolvable hints
                continue
            for name in ("data", "return"):
                found.update(_structs(hints.get(name)))
            for spec in (handler.responses or {}).values():
                found.update(_structs(spec.data_container))
    return found


# What a handler checks beyond its body's types, stated in the document so that a schema-valid
# body is an accepted one (issue #35). /tokenize: exactly one of prompt and messages (null is
# absent); with messages, add_special_tokens is not true, and continue_final_message needs
# add_generation_prompt false (its default is true).
_NULL = {"type": "null"}
COMPONENT_RULES: dict[str, dict[str, Any]] = {
    # Chat turns (prepare.template_messages): only an assistant turn carries tool calls, and a
    # `tool` turn names the call it answers.
    "ChatMessage": {
        "allOf": [
            {"if": {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
             "then": {"properties": {"role": {"const": "assistant"}}}},
            {"if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
             "then": {"required": ["tool_call_id"],
                      "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}},
        ]
    },
    "TokenizeRequest": {
        "oneOf": [
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": _NULL}},
            {
                "required": ["messages"],
                "properties": {"prompt": _NULL, "messages": {"type": "array", "minItems": 1},
                               "add_special_tokens": {"enum": [False, None]}},
                "if": {"required": ["continue_final_message"],
                       "properties": {"continue_final_message": {"const": True}}},
                "then": {"required": ["add_generation_prompt"],
                         "properties": {"add_generation_prompt": {"const": False}}},
            },
        ]
    },
}
# A batch input file must be UTF-8 JSONL (the upload is refused otherwise): text, not any bytes.
UPLOAD_FILE_SCHEMA = {"type": "string", "format": "binary", "contentMediaType": "application/jsonl",
                      "description": "UTF-8 JSONL, one batch request per line (other bytes are a 400)"}


def bound_token_ids(node: Any, max_token_id: int | None) -> None:
    """Every schema marked as a client's token id gets the served vocabulary's bound."""
    if isinstance(node, dict):
        if node.pop(TOKEN_ID_MARK, None) and max_token_id is not None:
            node["maximum"] = max_token_id
        for value in node.values():
            bound_token_ids(value, max_token_id)
    elif isinstance(node, list):
        for value in node:
            bound_token_ids(value, max_token_id)


def _text_uploads(document: dict[str, Any]) -> None:
    schemas = document.get("components", {}).get("schemas", {})
    for path in document.get("paths", {}).values():
        form = (path.get("post", {}).get("requestBody", {}).get("content", {}).get("multipart/form-data"))
        if not form:
            continue
        schema = form.get("schema", {})
        ref = schema.get("$ref", "")
        target = schemas.get(ref.rpartition("/")[2], {}) if ref else schema
        if "file" in target.get("properties", {}):
            target["properties"]["file"] = dict(UPLOAD_FILE_SCHEMA)
            form["encoding"] = {"file": {"contentType": "application/jsonl"}}


def refine(document: dict[str, Any], types: Iterable[type[msgspec.Struct]], *,
           max_token_id: int | None = None) -> dict[str, Any]:
    """Replaces the component schemas of `types` (and the structs they contain) with msgspec's,
    adds the handlers' own rules (`COMPONENT_RULES`, text uploads), and bounds client token ids by
    `max_token_id` (the smallest served vocabulary's last id)."""
    _, components = msgspec.json.schema_components(
        sorted(types, key=lambda t: t.__name__), ref_template=REF_TEMPLATE
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(components)
    for name, rule in COMPONENT_RULES.items():
        if name in schemas:
            schemas[name].update(rule)
    _text_uploads(document)
    bound_token_ids(document, max_token_id)
    return document


class ContractJsonPlugin(JsonRenderPlugin):
    """Serves the refined document; computed once, at the first request."""

    def __init__(self) -> None:
        super().__init__()
        self._rendered: bytes | None = None

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        if self._rendered is None:
            document = msgspec.json.decode(self.render_json(request, openapi_schema))
            tokenizers = services(request).generation.tokenizers
            vocab = [tokenizers.get(name).vocab_size for name in tokenizers.names()]
            max_token_id = min(vocab) - 1 if vocab else None
            self._rendered = msgspec.json.encode(refine(document, body_types(request.app), max_token_id=max_token_id))
        return self._rendered
