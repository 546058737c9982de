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


def refine(document: dict[str, Any], types: Iterable[type[msgspec.Struct]]) -> dict[str, Any]:
    """Replaces the component schemas of `types` (and the structs they contain) with msgspec's."""
    _, components = msgspec.json.schema_components(
        sorted(types, key=lambda t: t.__name__), ref_template=REF_TEMPLATE
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(components)
    return document


class ContractJsonPlugin(JsonRenderPlugin):
    """Serves the refined document; computed once, at the first request."""

    def __init__(self) -> None:
        super().__init__()
        self._rendered: bytes | None = None

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        if self._rendered is None:
            document = msgspec.json.decode(self.render_json(request, openapi_schema))
            self._rendered = msgspec.json.encode(refine(document, body_types(request.app)))
        return self._rendered
