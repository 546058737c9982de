"""The admin console over real HTTP (uvicorn, SQLite, the demo model in-process): sign-in and
sessions, CSRF, security headers, escaping, expiry, sign-out, audit. The browser tests
(tests/integration/console) drive the same pages in Chromium against `sluice serve`.
"""

from __future__ import annotations

import re
import secrets

import httpx
import pytest
from sqlalchemy import create_engine, text

from sluice.gateway.console.security import CONTENT_SECURITY_POLICY, SESSION_COOKIE

pytestmark = pytest.mark.integration

XSS = "<img src=x onerror=alert(1)>"


def login_nonce(client: httpx.Client) -> str:
    page = client.get("/console/login")
    assert page.status_code == 200
    match = re.search(r'name="nonce" value="([^"]+)"', page.text)
    assert match is not None
    return match.group(1)


def signed_in(gateway) -> tuple[httpx.Client, str]:
    """A client holding a console session, and the page's CSRF token."""
    client = httpx.Client(base_url=gateway.base_url, timeout=60)
    nonce = login_nonce(client)
    answer = client.post("/console/login", data={"token": gateway.admin_token, "nonce": nonce})
    assert answer.status_code == 303 and answer.headers["location"] == "/console"
    page = client.get("/console")
    match = re.search(r'hx-headers=\'\{"X-CSRF-Token": "([0-9a-f]+)"\}\'', page.text)
    assert match is not None, page.text[:500]
    return client, match.group(1)


def test_sign_in_sets_a_strict_httponly_cookie_and_pages_need_it(gateway) -> None:
    anonymous = httpx.Client(base_url=gateway.base_url, timeout=60)
    for path in ("/console", "/console/tenants", "/console/live"):
        answer = anonymous.get(path)
        assert answer.status_code == 303 and answer.headers["location"] == "/console/login"
    polled = anonymous.get("/console/live", headers={"hx-request": "true"})
    assert polled.status_code == 401 and polled.headers["hx-redirect"] == "/console/login"

    client = httpx.Client(base_url=gateway.base_url, timeout=60)
    nonce = login_nonce(client)
    wrong = client.post("/console/login", data={"token": "slc-admin-wrong", "nonce": nonce})
    assert wrong.status_code == 401 and "not a valid admin token" in wrong.text
    assert not any(c.startswith(SESSION_COOKIE + "=") for c in wrong.headers.get_list("set-cookie"))
    stale = client.post("/console/login", data={"token": gateway.admin_token, "nonce": "forged"})
    assert stale.status_code == 403  # the sign-in form's double-submit value must match its cookie
    nonce = login_nonce(client)
    answer = client.post("/console/login", data={"token": gateway.admin_token, "nonce": nonce})
    assert answer.status_code == 303
    cookie = next(c for c in answer.headers.get_list("set-cookie") if c.startswith(SESSION_COOKIE + "="))
    attributes = {part.strip().lower() for part in cookie.split(";")}
    assert {"httponly", "samesite=strict", "path=/console", "max-age=28800"} <= attributes
    value = cookie.split(";")[0].split("=", 1)[1]
    page = client.get("/console")
    assert page.status_code == 200 and value not in page.text and value not in str(page.url)
    assert gateway.admin_token not in page.text


def test_state_changes_need_the_csrf_header(gateway) -> None:
    client, csrf = signed_in(gateway)
    name = f"csrf-{secrets.token_hex(3)}"
    refused = client.post("/console/tenants", data={"name": name})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "csrf_failed"
    forged = client.post("/console/tenants", data={"name": name}, headers={"x-csrf-token": "0" * 64})
    assert forged.status_code == 403
    with gateway.admin() as admin:
        assert name not in {t["name"] for t in admin.get("/admin/tenants").json()["data"]}
    created = client.post("/console/tenants", data={"name": name}, headers={"x-csrf-token": csrf})
    assert created.status_code == 200 and created.headers["hx-redirect"].startswith("/console/tenants/ten_")


def test_security_headers_on_pages_errors_and_static_files(gateway) -> None:
    client, _ = signed_in(gateway)
    for answer in (client.get("/console"), client.get("/console/login"),
                   client.post("/console/tenants", data={})):  # 403: no CSRF header
        assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["cache-control"] == "no-store"
    script = client.get("/console/static/htmx.min.js")
    assert script.status_code == 200 and "htmx" in script.text[:200]
    assert script.headers["x-content-type-options"] == "nosniff"
    page = client.get("/console").text
    assert "<script>" not in page  # no inline script
    assert all(src.startswith("/console/static/") for src in re.findall(r'<script src="([^"]+)"', page))
    assert re.search(r"\son[a-z]+=", page) is None  # no inline event handlers either


def test_tenant_supplied_text_is_escaped_everywhere(gateway) -> None:
    client, csrf = signed_in(gateway)
    headers = {"x-csrf-token": csrf, "hx-request": "true"}
    name = f"xss-{secrets.token_hex(3)}"
    created = client.post("/console/tenants", data={"name": name, "description": XSS}, headers=headers)
    tenant_path = created.headers["hx-redirect"]
    key = client.post(tenant_path + "/keys", data={"name": XSS}, headers=headers)
    assert key.status_code == 200
    bad_name = client.post("/console/tenants", data={"name": XSS}, headers=headers)
    assert bad_name.status_code == 400 and bad_name.headers["hx-retarget"] == "#flash"
    for body in (client.get("/console/tenants").text, client.get(tenant_path).text, key.text, bad_name.text):
        assert XSS not in body and "<img" not in body
    assert "&lt;img src=x onerror=alert(1)&gt;" in client.get(tenant_path).text


def test_new_key_is_shown_once_and_actions_are_audited(gateway) -> None:
    client, csrf = signed_in(gateway)
    headers = {"x-csrf-token": csrf, "hx-request": "true"}
    created = client.post("/console/tenants", data={"name": f"keys-{secrets.token_hex(3)}",
                                                   "requests_per_minute": "30"}, headers=headers)
    tenant_path = created.headers["hx-redirect"]
    tenant_id = tenant_path.rsplit("/", 1)[1]
    issued = client.post(tenant_path + "/keys", data={"name": "app"}, headers=headers)
    key = re.search(r'id="new-key">(sk-slc-[A-Za-z0-9_-]+)<', issued.text)
    assert key is not None
    assert key.group(1) not in client.get(tenant_path).text  # never again
    with gateway.client(key.group(1)) as app:
        assert app.get("/v1/models").status_code == 200
    key_id = re.search(r'data-key="(key_[0-9a-f]+)"', issued.text).group(1)  # type: ignore[union-attr]
    rotated = client.post(f"{tenant_path}/keys/{key_id}/rotate", headers=headers)
    new_key = re.search(r'id="new-key">(sk-slc-[A-Za-z0-9_-]+)<', rotated.text).group(1)  # type: ignore[union-attr]
    with gateway.client(key.group(1)) as app:
        assert app.get("/v1/models").status_code == 401
    with gateway.client(new_key) as app:
        assert app.get("/v1/models").status_code == 200
    assert client.post(tenant_path + "/quotas", data={"requests_per_minute": "x"}, headers=headers).status_code == 400
    saved = client.post(tenant_path + "/quotas", data={"requests_per_minute": "7", "max_queued": ""}, headers=headers)
    assert saved.status_code == 200 and "Quotas saved." in saved.text
    settings = client.post(tenant_path, data={"weight": "2.5", "priority_ceiling": "interactive",
                                              "default_class": "standard", "allowed_models": "demo"},
                           headers=headers)
    assert settings.status_code == 200
    disabled = client.post(tenant_path + "/enabled", data={"enabled": "false"}, headers=headers)
    assert "disabled" in disabled.text
    with gateway.admin() as admin:
        tenant = admin.get(f"/admin/tenants/{tenant_id}").json()
        assert tenant["weight"] == 2.5 and tenant["allowed_models"] == ["demo"] and not tenant["enabled"]
        assert tenant["quotas"]["requests_per_minute"] == 7
        audit = admin.get("/admin/audit", params={"target": tenant_id}).json()["data"]
    actions = [(a["actor"], a["action"]) for a in reversed(audit)]
    assert actions == [("console", "tenant.create"), ("console", "key.create"), ("console", "key.rotate"),
                       ("console", "quota.update"), ("console", "tenant.update"), ("console", "tenant.update")]
    assert all(new_key not in str(a["details"]) for a in audit)


def test_live_sections_render_out_of_band(gateway) -> None:
    client, _ = signed_in(gateway)
    answer = client.get("/console/live", headers={"hx-request": "true"})
    assert answer.status_code == 200, answer.text[:300]
    for section in ("queues", "workers", "charts", "batches", "events"):
        assert f'<div id="{section}" hx-swap-oob="innerHTML">' in answer.text
    assert "local-demo" in answer.text
    assert "not enabled" in answer.text  # no Batch API in this app
    drained = client.post("/console/workers/local-demo/drain", headers={"hx-request": "true",
                                                                         "x-csrf-token": signed_in(gateway)[1]})
    assert drained.status_code == 403  # another session's token is not this one's


def test_sign_out_and_expiry_end_the_session(gateway) -> None:
    client, csrf = signed_in(gateway)
    out = client.post("/console/logout", headers={"x-csrf-token": csrf, "hx-request": "true"})
    assert out.status_code == 200 and out.headers["hx-redirect"] == "/console/login"
    assert client.get("/console").status_code == 303
    client, csrf = signed_in(gateway)
    engine = create_engine(gateway.database_url.replace("+aiosqlite", ""))
    with engine.begin() as conn:  # as if 8 hours had passed
        conn.execute(text("UPDATE console_session SET expires_at = '2000-01-01 00:00:00'"))
    engine.dispose()
    assert client.get("/console").status_code == 303
    polled = client.get("/console/live", headers={"hx-request": "true"})
    assert polled.status_code == 401 and polled.headers["hx-redirect"] == "/console/login"
    with gateway.admin() as admin:
        audit = admin.get("/admin/audit", params={"target": "console"}).json()["data"]
    assert {"console.sign_in", "console.sign_out"} <= {a["action"] for a in audit}


def test_the_objectives_section_shows_attainment_per_class_and_tenant(gateway) -> None:
    """A tenant's interactive requests (targets from [objectives]) appear in the live objectives
    section with the share that met them and the targets; batch has no objective and no row."""
    tenant, key = gateway.tenant(priority_ceiling="interactive", default_class="interactive")
    with gateway.client(key) as app:
        for tier in ({}, {}, {"service_tier": "flex"}):  # the tenant's default class (interactive) twice, batch
            answer = app.post("/v1/chat/completions", json={"model": "demo", "max_tokens": 3, **tier,
                                                             "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200, answer.text
    client, _ = signed_in(gateway)
    live = client.get("/console/live", headers={"hx-request": "true"}).text
    assert '<div id="slo" hx-swap-oob="innerHTML">' in live
    row = re.search(rf'<tr data-class="interactive" data-tenant="{tenant["name"]}">(.*?)</tr>', live, re.S)
    assert row is not None, live[live.find('id="slo"'):][:2000]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)
    assert cells[2] == "2" and cells[3] in ("100%", "50%", "0%")  # two requests judged
    assert (cells[6], cells[8]) == ("3.0 s", "300 ms")  # the interactive class's targets
    assert f'data-class="batch" data-tenant="{tenant["name"]}"' not in live
