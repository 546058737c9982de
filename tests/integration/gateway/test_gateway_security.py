"""Security: credentials never cross (tenant vs admin), revocation is immediate, tenants are
isolated, and no secret ever reaches the logs."""

from __future__ import annotations

import datetime as dt
import logging

import pytest

pytestmark = pytest.mark.integration

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_admin_and_tenant_credentials_do_not_cross(gateway) -> None:
    _, key = gateway.tenant()
    with gateway.client(key) as tenant_client:
        assert tenant_client.get("/admin/tenants").status_code == 403
    with gateway.client(gateway.admin_token) as admin_as_tenant:
        assert admin_as_tenant.post("/v1/chat/completions", json=CHAT).status_code in (401, 403)
    with gateway.client("garbage") as nobody:
        assert nobody.get("/admin/tenants").status_code == 401
        assert nobody.get("/v1/models").status_code == 401
    import httpx

    with httpx.Client(base_url=gateway.base_url) as anonymous:
        missing = anonymous.get("/v1/models")
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        assert anonymous.get("/admin/tenants").status_code == 401
        weird = anonymous.get("/v1/models", headers={"authorization": "Basic Zm9vOmJhcg=="})
        assert weird.status_code == 401


def test_revoked_and_expired_keys_fail_at_once(gateway) -> None:
    tenant, key = gateway.tenant()
    with gateway.client(key) as client, gateway.admin() as admin:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # now cached
        keys = admin.get(f"/admin/tenants/{tenant['id']}/keys").json()["data"]
        assert all("key" not in k and "hash" not in k for k in keys)
        assert admin.delete(f"/admin/tenants/{tenant['id']}/keys/{keys[0]['id']}").status_code == 200
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 401

        soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
        expiring = admin.post(
            f"/admin/tenants/{tenant['id']}/keys", json={"expires_at": soon.isoformat()}
        ).json()
        with gateway.client(expiring["key"]) as short:
            assert short.get("/v1/models").status_code == 200
            import time

            time.sleep(max(0.0, (soon - dt.datetime.now(dt.UTC)).total_seconds()) + 0.1)
            expired = short.get("/v1/models")
            assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]

        fresh = admin.post(f"/admin/tenants/{tenant['id']}/keys", json={}).json()
        rotated = admin.post(f"/admin/tenants/{tenant['id']}/keys/{fresh['id']}/rotate").json()
        with gateway.client(fresh["key"]) as old, gateway.client(rotated["key"]) as new:
            assert old.get("/v1/models").status_code == 401
            assert new.get("/v1/models").status_code == 200


def test_tenant_sees_only_its_own_usage(gateway) -> None:
    a, key_a = gateway.tenant()
    b, key_b = gateway.tenant()
    with gateway.client(key_a) as client_a, gateway.client(key_b) as client_b:
        assert client_a.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert client_b.post("/v1/chat/completions", json=CHAT).status_code == 200
        import time

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rows_a = client_a.get("/v1/usage").json()["data"]
            rows_b = client_b.get("/v1/usage", params={"tenant_id": a["id"]}).json()["data"]  # param ignored
            if rows_a and rows_b:
                break
            time.sleep(0.05)
    assert {r["tenant_id"] for r in rows_a} == {a["id"]}
    assert {r["tenant_id"] for r in rows_b} == {b["id"]}
    today = dt.datetime.now(dt.UTC).date().isoformat()
    with gateway.client(key_a) as client_a:
        assert client_a.get("/v1/usage", params={"start": today, "end": today}).json()["data"]
        assert client_a.get("/v1/usage", params={"start": "not-a-date"}).status_code == 400


def test_secrets_never_logged(gateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    tenant, key = gateway.tenant()
    with gateway.client(key) as client, gateway.admin() as admin:
        client.post("/v1/chat/completions", json=CHAT)
        client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        client.post("/v1/chat/completions", content=b"{broken")
        created = admin.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": "x"}).json()
        admin.post(f"/admin/tenants/{tenant['id']}/keys/{created['id']}/rotate")
        audit = admin.get("/admin/audit").text
    with gateway.client(key + "x") as bad:
        bad.get("/v1/models")
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    for secret in [gateway.admin_token, *gateway.secrets_seen, created["key"]]:
        assert secret not in logged
        assert secret not in audit


def test_metrics_need_the_metrics_token_or_the_admin_token(gateway) -> None:
    """/metrics names tenants and counts their tokens: closed to anonymous callers and tenant keys."""
    import httpx

    tenant, key = gateway.tenant()
    with gateway.client(key) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    url = gateway.base_url + "/metrics"
    for headers in ({}, {"authorization": f"Bearer {key}"}, {"authorization": "Bearer metrics-wrong"},
                    {"authorization": f"Basic {gateway.metrics_token}"}):
        denied = httpx.get(url, headers=headers)
        assert denied.status_code == 401 and tenant["name"] not in denied.text
        assert set(denied.json()["error"]) == {"message", "type", "param", "code"}
    for token in (gateway.metrics_token, gateway.admin_token):
        allowed = httpx.get(url, headers={"authorization": f"Bearer {token}"})
        assert allowed.status_code == 200 and "sluice:" in allowed.text
