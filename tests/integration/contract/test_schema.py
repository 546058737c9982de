"""The served OpenAPI document against the application: its routes, its answers, its bounds.

The route table comes from the app `sluice serve` builds (create_app with the Batch API routes);
the document and every answer come from the running `sluice serve` process.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import msgspec
import pytest
from litestar.routes import HTTPRoute

from sluice.gateway.admin.schemas import KeyCreate, QuotasPatch, TenantCreate, TenantPatch
from sluice.gateway.app import create_app
from sluice.gateway.batches import batch_components
from sluice.gateway.batches.controllers import BatchCreate
from sluice.gateway.edge.errors import ErrorResponse
from sluice.gateway.edge.openapi import COMPONENT_RULES, REF_TEMPLATE, bound_token_ids
from sluice.gateway.edge.schemas import ChatCompletionRequest, CompletionRequest
from sluice.gateway.queueing.acceptance import KafkaBackend
from sluice.settings import KafkaSettings, Settings

from .conftest import ADMIN_TOKEN, Served

pytestmark = [pytest.mark.integration, pytest.mark.slow]

METHODS = ("get", "post", "put", "patch", "delete")
ERROR_REF = "#/components/schemas/ErrorResponse"


def real_routes() -> set[tuple[str, str]]:
    """(path template, method) of every API route of the app that `sluice serve` runs."""
    settings = Settings(kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"))
    batches = batch_components(settings)
    app = create_app(
        settings, KafkaBackend(settings, batch_handler=batches.handler), batches=batches
    )
    return {
        (re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path), method.lower())
        for route in app.routes
        if isinstance(route, HTTPRoute) and not route.path.startswith("/schema")
        for handler in route.route_handlers
        if handler.resolve_include_in_schema()  # the console's browser pages are not API
        for method in handler.http_methods
        if method not in ("OPTIONS", "HEAD")
    }


def concrete(path: str) -> str:
    return re.sub(r"\{\w+\}", "nothing-here", path)


def operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, ops in document["paths"].items() for method, op in ops.items()]


def is_error_object(answer: httpx.Response) -> bool:
    error = answer.json().get("error")
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}


def test_document_has_exactly_the_apps_routes(served: Served) -> None:
    documented = {(path, method) for path, method, _ in operations(served.schema())}
    assert documented == real_routes()


def test_every_error_answer_is_documented_as_the_openai_error_object(served: Served) -> None:
    document = served.schema()
    components = document["components"]["schemas"]
    assert components["ErrorResponse"]["required"] == ["error"]
    assert set(components["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    assert "status_code" not in str(document)  # Litestar's default error body is nowhere
    for path, method, op in operations(document):
        for status, response in op["responses"].items():
            if int(status) < 400 or path in ("/ready", "/health"):  # probes: their 503 body is a status
                continue
            assert response["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}, (path, method, status)
        if path.startswith(("/v1", "/admin", "/tokenize", "/detokenize")):
            assert {"400", "401", "403"} <= set(op["responses"]), (path, method)
            scheme = "adminToken" if path.startswith("/admin") else "apiKey"
            assert op["security"] == [{scheme: []}], (path, method)
        if "{" in path:
            assert "404" in op["responses"], (path, method)
        if "requestBody" in op:
            assert "413" in op["responses"], (path, method)
    assert document["paths"]["/ready"]["get"]["responses"]["503"]
    assert document["paths"]["/health"]["get"]["responses"]["503"]  # draining (gateway/cluster/drain.py)
    metrics = document["paths"]["/metrics"]["get"]
    assert "401" in metrics["responses"] and metrics["security"] == [{"metricsToken": []}, {"adminToken": []}]


def test_body_schemas_are_the_validators_own(served: Served) -> None:
    """Every bound, enum and pattern in the document is the one msgspec enforces."""
    served_components = served.schema()["components"]["schemas"]
    types = [ChatCompletionRequest, CompletionRequest, BatchCreate, TenantCreate, TenantPatch, QuotasPatch,
             KeyCreate, ErrorResponse]
    _, components = msgspec.json.schema_components(types, ref_template=REF_TEMPLATE)
    # A client's token ids are bounded by the served vocabulary (the demo model's 512 tokens).
    bound_token_ids(components, 511)
    for name, schema in components.items():
        assert served_components[name] == {**schema, **COMPONENT_RULES.get(name, {})}, name
    # Bounds that Litestar on its own dropped (zero) or never had.
    chat = served_components["ChatCompletionRequest"]["properties"]
    assert {
        k: v for k, v in chat["top_p"]["anyOf"][0].items() if k != "description"
    } == {"type": "number", "minimum": 0.0, "maximum": 1.0}
    assert chat["top_k"]["anyOf"][0]["maximum"] == 2**31 - 1
    assert chat["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == 2**31 - 1
    prompt_ids = served_components["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["items"]
    assert (prompt_ids["minimum"], prompt_ids["maximum"]) == (0, 511)
    assert served_components["TenantCreate"]["properties"]["weight"]["exclusiveMinimum"] == 0


def test_query_parameter_bounds_are_documented(served: Served) -> None:
    paths = served.schema()["paths"]

    def limit(path: str) -> dict[str, Any]:
        return next(p["schema"] for p in paths[path]["get"]["parameters"] if p["name"] == "limit")

    assert (limit("/v1/files")["minimum"], limit("/v1/files")["maximum"]) == (1, 100)
    assert (limit("/v1/batches")["minimum"], limit("/v1/batches")["maximum"]) == (1, 100)
    assert (limit("/admin/audit")["minimum"], limit("/admin/audit")["maximum"]) == (1, 1000)
    _, key = served.new_tenant()
    with served.client(key) as client:
        for value in ("0", "101", "abc"):
            answer = client.get("/v1/files", params={"limit": value})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "limit", answer.text
            assert "query parameter" in answer.json()["error"]["message"]
        assert client.get("/v1/files", params={"limit": "100"}).status_code == 200


def test_options_and_405_allow_every_method_of_the_path(served: Served) -> None:
    _, key = served.new_tenant()
    for path, ops in served.schema()["paths"].items():
        documented = {m.upper() for m in ops} | {"OPTIONS"}
        options = httpx.options(served.base_url + concrete(path), timeout=30)  # public: no credentials
        assert options.status_code == 204, (path, options.text)
        assert set(options.headers["allow"].split(", ")) == documented, path
        token = ADMIN_TOKEN if path.startswith("/admin") else key
        for method in METHODS:
            if method in ops:
                continue
            answer = httpx.request(method.upper(), served.base_url + concrete(path), timeout=30,
                                   headers={"authorization": f"Bearer {token}"})
            assert answer.status_code == 405, (method, path, answer.text)
            assert set(answer.headers["allow"].split(", ")) == documented, (method, path)
            assert is_error_object(answer)


def test_each_documented_error_status_really_happens(served: Served) -> None:
    """Provokes the statuses the issue found undocumented; each is in the document, with the error body."""
    document = served.schema()
    _, key = served.new_tenant()
    tenant = {"authorization": f"Bearer {key}"}
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    upload = {"files": {"file": ("in.jsonl", b'{"custom_id": 1}\n')}, "data": {"purpose": "batch"}}
    cases: list[tuple[str, str, str, dict[str, Any], int]] = [
        ("get", "/v1/files/{file_id}", "/v1/files/file_nope", {"headers": tenant}, 404),
        ("get", "/v1/files/{file_id}/content", "/v1/files/file_nope/content", {"headers": tenant}, 404),
        ("delete", "/v1/files/{file_id}", "/v1/files/file_nope", {"headers": tenant}, 404),
        ("get", "/v1/batches/{batch_id}", "/v1/batches/batch_nope", {"headers": tenant}, 404),
        ("post", "/v1/batches/{batch_id}/cancel", "/v1/batches/batch_nope/cancel", {"headers": tenant}, 404),
        ("get", "/v1/files", "/v1/files?after=file_nope", {"headers": tenant}, 404),
        ("post", "/v1/files", "/v1/files", {"headers": tenant, **upload}, 400),
        ("post", "/v1/files", "/v1/files", {}, 401),
        ("post", "/v1/files", "/v1/files", {"headers": admin, **upload}, 403),
        ("post", "/v1/batches", "/v1/batches",
         {"headers": tenant, "json": {"input_file_id": "file_nope", "endpoint": "/v1/completions"}}, 404),
        ("post", "/v1/batches", "/v1/batches",
         {"headers": tenant, "json": {"input_file_id": "f", "endpoint": "/v1/embeddings"}}, 400),
        ("post", "/v1/chat/completions", "/v1/chat/completions",
         {"headers": tenant, "json": {"model": "nope", "messages": [{"role": "user", "content": "x"}]}}, 404),
        ("post", "/v1/chat/completions", "/v1/chat/completions",
         {"headers": tenant, "content": b"x" * (2 * 2**20), "headers_extra": {"content-type": "application/json"}},
         413),
        ("get", "/admin/tenants", "/admin/tenants", {"headers": tenant}, 403),
        ("get", "/admin/tenants/{tenant_id}", "/admin/tenants/ten_nope", {"headers": admin}, 404),
        ("post", "/admin/tenants", "/admin/tenants", {"headers": admin, "json": {"name": "contract-dup"}}, 409),
    ]
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        assert client.post("/admin/tenants", json={"name": "contract-dup"}, headers=admin).status_code in (201, 409)
        for method, template, url, kwargs, status in cases:
            headers = {**kwargs.pop("headers", {}), **kwargs.pop("headers_extra", {})}
            answer = client.request(method.upper(), url, headers=headers, **kwargs)
            assert answer.status_code == status, (method, url, answer.text)
            assert str(status) in document["paths"][template][method]["responses"], (method, template, status)
            assert is_error_object(answer), (method, url, answer.text)
