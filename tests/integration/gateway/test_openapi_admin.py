"""The admin API end to end, and the OpenAPI document covering every route."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_openapi_documents_every_route(gateway) -> None:
    import httpx

    schema = httpx.get(gateway.base_url + "/schema/openapi.json", timeout=30).json()
    paths = schema["paths"]
    expected = {
        ("/v1/models", "get"),
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/usage", "get"),
        ("/admin/tenants", "post"),
        ("/admin/tenants", "get"),
        ("/admin/tenants/{tenant_id}", "get"),
        ("/admin/tenants/{tenant_id}", "patch"),
        ("/admin/tenants/{tenant_id}", "delete"),
        ("/admin/tenants/{tenant_id}/keys", "post"),
        ("/admin/tenants/{tenant_id}/keys", "get"),
        ("/admin/tenants/{tenant_id}/keys/{key_id}", "delete"),
        ("/admin/tenants/{tenant_id}/keys/{key_id}/rotate", "post"),
        ("/admin/tenants/{tenant_id}/quotas", "get"),
        ("/admin/tenants/{tenant_id}/quotas", "patch"),
        ("/admin/usage", "get"),
        ("/admin/queues", "get"),
        ("/admin/workers", "get"),
        ("/admin/audit", "get"),
        ("/health", "get"),
        ("/ready", "get"),
        ("/metrics", "get"),
    }
    documented = {(path, method) for path, ops in paths.items() for method in ops}
    assert expected <= documented
    for path, method in expected:
        operation = paths[path][method]
        ok = next(code for code in operation["responses"] if code.startswith("2"))
        assert operation["responses"][ok].get("content") or path == "/metrics", (path, method)
        if method in ("post", "patch") and not path.endswith("/rotate"):
            assert operation["requestBody"]["content"]["application/json"]["schema"], (path, method)
        if path.startswith(("/v1", "/admin")):
            assert "400" in operation["responses"] and "401" in operation["responses"], (path, method)
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat.get("$ref", "").endswith("ChatCompletionRequest")


def test_admin_flow(gateway) -> None:
    with gateway.admin() as admin:
        bad = admin.post("/admin/tenants", json={"name": "x y", "weight": -1})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        created = admin.post(
            "/admin/tenants",
            json={
                "name": "admin-flow",
                "description": "d",
                "priority_ceiling": "standard",
                "default_class": "batch",
                "weight": 2.0,
                "allowed_models": ["demo"],
                "quotas": {"requests_per_minute": 10},
            },
        ).json()
        assert created["id"].startswith("ten_") and created["quotas"]["requests_per_minute"] == 10
        assert admin.post("/admin/tenants", json={"name": "admin-flow"}).status_code == 409
        assert (
            admin.post(
                "/admin/tenants",
                json={"name": "inverted", "priority_ceiling": "batch", "default_class": "interactive"},
            ).status_code
            == 400
        )
        tid = created["id"]
        assert any(t["id"] == tid for t in admin.get("/admin/tenants").json()["data"])
        patched = admin.patch(
            f"/admin/tenants/{tid}", json={"weight": 3.0, "quotas": {"tokens_per_day": 500}}
        )
        assert patched.json()["weight"] == 3.0 and patched.json()["quotas"]["tokens_per_day"] == 500
        assert patched.json()["quotas"]["requests_per_minute"] == 10
        assert admin.get("/admin/tenants/ten_missing").status_code == 404
        assert admin.patch(f"/admin/tenants/{tid}/quotas", json={"max_queued": -3}).status_code == 400
        key = admin.post(f"/admin/tenants/{tid}/keys", json={"name": "k", "expires_in_days": 30}).json()
        assert key["key"].startswith(key["prefix"]) and key["expires_at"]
        with gateway.client(key["key"]) as client:
            chat = client.post(
                "/v1/chat/completions",
                json={
                    "model": "demo",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "service_tier": "priority",
                },
            )
            assert (
                chat.status_code == 200 and chat.json()["service_tier"] == "default"
            )  # capped at its ceiling
            assert chat.headers["x-sluice-class"] == "standard"
            unasked = client.post(
                "/v1/chat/completions",
                json={"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            # The tenant's default class (batch) is in the header; the body echoes that no tier was asked.
            assert unasked.json()["service_tier"] == "default" and unasked.headers["x-sluice-class"] == "batch"
        assert "workers" in admin.get("/admin/workers").json()
        assert "queues" in admin.get("/admin/queues").json()
        actions = [e["action"] for e in admin.get("/admin/audit", params={"target": tid}).json()["data"]]
        assert actions[-1] == "tenant.create" and "tenant.update" in actions and "key.create" in actions
        import time

        deadline = time.monotonic() + 30
        while not admin.get("/admin/usage", params={"tenant_id": tid}).json()["data"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        deleted = admin.delete(f"/admin/tenants/{tid}").json()
        assert deleted["disabled"] and not deleted["deleted"]
        with gateway.client(key["key"]) as client:
            assert client.get("/v1/models").status_code == 403


def test_health_ready_metrics(gateway) -> None:
    import httpx

    assert httpx.get(gateway.base_url + "/health").json() == {"status": "ok"}
    ready = httpx.get(gateway.base_url + "/ready")
    assert ready.status_code == 200 and ready.json()["checks"] == {"accepting": True, "database": True, "workers": True}
    assert httpx.get(gateway.base_url + "/metrics").status_code == 401
    metrics = httpx.get(gateway.base_url + "/metrics", headers={"authorization": f"Bearer {gateway.admin_token}"})
    assert metrics.status_code == 200 and "text/plain" in metrics.headers["content-type"]
