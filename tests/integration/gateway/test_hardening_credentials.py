"""Issue #36, credentials: console sessions end when the admin token changes, and "sign out
everywhere" ends them all (item 6); guessing the admin token is slowed down per source address,
logged and audited, across replicas with Redis, and a weak admin token is refused at start (item 7).

The gateway app over HTTP through Litestar's test client (a fresh app per test, so each has its
own failure counters), SQLite migrated by Alembic, the demo model in-process. A restart is a new
app on the same database.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from sluice.errors import ConfigError
from sluice.gateway.app import create_app
from sluice.gateway.auth.attempts import MAX_FAILURES
from sluice.gateway.queueing.local import LocalEngineBackend
from sluice.settings import (
    AdminSettings,
    DatabaseSettings,
    GatewaySettings,
    Settings,
    SharedSettings,
    load_settings,
)
from sluice_lab.experiments.cluster import drop_redis_prefix

pytestmark = pytest.mark.integration


def _app(model_dir: Path, database: Path, admin_token: str, shared: SharedSettings | None = None) -> Any:
    settings = Settings(admin=AdminSettings(token=admin_token), shared=shared or SharedSettings(),
                        database=DatabaseSettings(url=f"sqlite+aiosqlite:///{database}"))
    backend = LocalEngineBackend({"demo": model_dir}, {"max_num_seqs": 2, "kv_cache_bytes": 8 * 2**20})
    return create_app(settings, backend)


async def _nonce(client: AsyncTestClient[Any]) -> str:
    page = await client.get("/console/login")
    match = re.search(r'name="nonce" value="([^"]+)"', page.text)
    assert match is not None
    return match.group(1)


async def _sign_in(client: AsyncTestClient[Any], token: str) -> str:
    """Signs `client` in; returns the page's CSRF token."""
    answer = await client.post("/console/login", data={"token": token, "nonce": await _nonce(client)},
                               follow_redirects=False)
    assert answer.status_code == 303, answer.text
    page = await client.get("/console")
    match = re.search(r'hx-headers=\'\{"X-CSRF-Token": "([0-9a-f]+)"\}\'', page.text)
    assert match is not None
    return match.group(1)


async def test_a_new_admin_token_ends_the_old_sessions(demo_model_dir: Path, tmp_path: Path) -> None:
    old, new = "slc-admin-" + secrets.token_urlsafe(24), "slc-admin-" + secrets.token_urlsafe(24)
    database = tmp_path / "sluice.db"
    async with AsyncTestClient(_app(demo_model_dir, database, old), base_url="http://sluice.test") as client:
        csrf = await _sign_in(client, old)
        cookies = dict(client.cookies)
        assert (await client.get("/console")).status_code == 200
    async with AsyncTestClient(_app(demo_model_dir, database, new), base_url="http://sluice.test") as client:
        client.cookies.update(cookies)
        assert (await client.get("/console", follow_redirects=False)).status_code == 303  # to the sign-in form
        created = await client.post("/console/tenants", data={"name": "after-rotation"},
                                    headers={"x-csrf-token": csrf}, follow_redirects=False)
        assert created.status_code in (303, 401), created.text
        tenants = await client.get("/admin/tenants", headers={"authorization": f"Bearer {new}"})
        assert "after-rotation" not in {t["name"] for t in tenants.json()["data"]}
        client.cookies.clear()
        await _sign_in(client, new)  # the new token signs in as before
        assert (await client.get("/console")).status_code == 200


async def test_sign_out_everywhere_ends_every_session(demo_model_dir: Path, tmp_path: Path) -> None:
    token = "slc-admin-" + secrets.token_urlsafe(24)
    app = _app(demo_model_dir, tmp_path / "sluice.db", token)
    async with (AsyncTestClient(app, base_url="http://sluice.test") as first,
                AsyncTestClient(app, base_url="http://sluice.test") as second):
        csrf = await _sign_in(first, token)
        await _sign_in(second, token)
        ended = await first.post("/console/logout-everywhere", headers={"x-csrf-token": csrf})
        assert ended.status_code == 200 and ended.headers["hx-redirect"] == "/console/login"
        for client in (first, second):
            assert (await client.get("/console", follow_redirects=False)).status_code == 303
        audit = await first.get("/admin/audit", headers={"authorization": f"Bearer {token}"})
        assert "console.sign_out_everywhere" in {row["action"] for row in audit.json()["data"]}


async def test_guessing_the_admin_token_is_slowed_and_audited(demo_model_dir: Path, tmp_path: Path) -> None:
    token = "slc-admin-" + secrets.token_urlsafe(24)
    async with AsyncTestClient(_app(demo_model_dir, tmp_path / "sluice.db", token),
                               base_url="http://sluice.test") as client:
        for i in range(MAX_FAILURES):
            nonce = await _nonce(client)
            wrong = await client.post("/console/login", data={"token": f"guess-{i}", "nonce": nonce})
            assert wrong.status_code == 401
        nonce = await _nonce(client)
        limited = await client.post("/console/login", data={"token": "guess-x", "nonce": nonce})
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1, limited.text
        # The right token too, from this address, and the admin API as well: a guesser learns nothing.
        right = await client.post("/console/login", data={"token": token, "nonce": await _nonce(client)})
        assert right.status_code == 429
        bearer = await client.get("/admin/tenants", headers={"authorization": f"Bearer {token}"})
        assert bearer.status_code == 429 and bearer.json()["error"]["code"] == "too_many_sign_in_attempts"
    async with AsyncTestClient(_app(demo_model_dir, tmp_path / "sluice.db", token),
                               base_url="http://sluice.test") as client:  # a restart: fresh counters
        for i in range(MAX_FAILURES):
            wrong = await client.get("/admin/tenants", headers={"authorization": f"Bearer guess-{i}"})
            assert wrong.status_code == 401
        assert (await client.get("/admin/tenants", headers={"authorization": "Bearer x"})).status_code == 429
        audit = await client.get("/admin/audit", params={"limit": 100}, headers={"authorization": f"Bearer {token}"})
    # the restart above is what let the right token in again (its counters are fresh)
    assert audit.status_code == 429
    async with AsyncTestClient(_app(demo_model_dir, tmp_path / "sluice.db", token),
                               base_url="http://sluice.test") as client:
        audit = await client.get("/admin/audit", params={"limit": 100}, headers={"authorization": f"Bearer {token}"})
        rows = [row for row in audit.json()["data"] if row["action"] == "admin.sign_in_failed"]
        assert len(rows) == 2 * MAX_FAILURES  # each failure under the limit; none past it
        assert {row["target"] for row in rows} == {"console", "admin API"}


async def test_the_sign_in_limit_holds_across_replicas(demo_model_dir: Path, tmp_path: Path) -> None:
    """With Redis, the failures counted by one replica count on every other: a guesser spreading
    its guesses over two replicas gets the limit once, not twice."""
    url = os.environ.get("SLUICE_TEST_REDIS_URL", "")
    if not url:
        pytest.skip("SLUICE_TEST_REDIS_URL is not set: no Redis to share the counters")
    shared = SharedSettings(url=url, prefix=f"sluice-test-{secrets.token_hex(6)}")
    token = "slc-admin-" + secrets.token_urlsafe(24)
    try:
        async with AsyncTestClient(_app(demo_model_dir, tmp_path / "sluice.db", token, shared),
                                   base_url="http://a.test") as a, \
                AsyncTestClient(_app(demo_model_dir, tmp_path / "sluice.db", token, shared),
                                base_url="http://b.test") as b:
            for i in range(MAX_FAILURES):
                client = (a, b)[i % 2]
                wrong = await client.get("/admin/tenants", headers={"authorization": f"Bearer guess-{i}"})
                assert wrong.status_code == 401
            for client in (a, b):
                limited = await client.get("/admin/tenants", headers={"authorization": f"Bearer {token}"})
                assert limited.status_code == 429, limited.text
                assert limited.json()["error"]["code"] == "too_many_sign_in_attempts"
                assert 1 <= int(limited.headers["retry-after"]) <= 60
                login = await client.post("/console/login", data={"token": token, "nonce": await _nonce(client)})
                assert login.status_code == 429
    finally:
        await drop_redis_prefix(url, shared.prefix)


def test_a_weak_admin_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(tmp_path, environ={"SLUICE_ADMIN_TOKEN": "a"})
    assert "at least 16 characters" in str(caught.value)
    assert load_settings(tmp_path, environ={"SLUICE_ADMIN_TOKEN": "x" * 16}).admin.token == "x" * 16


@pytest.mark.parametrize("swagger_ui", [False, True])
async def test_the_swagger_ui_is_opt_in(demo_model_dir: Path, tmp_path: Path, swagger_ui: bool) -> None:
    """Item 8: scripts from a public CDN run on the console's origin only when the operator asks."""
    settings = Settings(admin=AdminSettings(token="slc-admin-" + secrets.token_urlsafe(24)),
                        gateway=GatewaySettings(swagger_ui=swagger_ui),
                        database=DatabaseSettings(url=f"sqlite+aiosqlite:///{tmp_path / 'sluice.db'}"))
    backend = LocalEngineBackend({"demo": demo_model_dir}, {"max_num_seqs": 2, "kv_cache_bytes": 8 * 2**20})
    async with AsyncTestClient(create_app(settings, backend), base_url="http://sluice.test") as client:
        page = await client.get("/schema/swagger")
        assert ("<script" in page.text) is swagger_ui, page.status_code
        assert (await client.get("/schema/openapi.json")).status_code == 200
