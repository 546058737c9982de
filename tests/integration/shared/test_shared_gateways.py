"""Two gateway apps ("replicas A and B") on one database and one Redis: an admin change made
through A reaches B's key cache within 1 s (its cache TTL is 300 s, so only the invalidation
can explain it), a tenant's requests-per-minute limit holds across both, and a request's slot is
free on the other app as soon as its answer has arrived."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from sluice.gateway.app import create_app
from sluice.gateway.queueing.local import LocalEngineBackend
from sluice.settings import AdminSettings, DatabaseSettings, GatewaySettings, Settings, SharedSettings

pytestmark = pytest.mark.integration

PROPAGATION_S = 1.0


@pytest.fixture
async def two_replicas(
    demo_model_dir: Path, tmp_path: Path, redis_url: str, prefix: str
) -> AsyncIterator[tuple[AsyncTestClient[Any], AsyncTestClient[Any], dict[str, str]]]:
    admin_token = "slc-admin-" + secrets.token_urlsafe(32)
    settings = Settings(
        gateway=GatewaySettings(key_cache_ttl_s=300.0),
        admin=AdminSettings(token=admin_token, demo_tenant=""),
        database=DatabaseSettings(url=f"sqlite+aiosqlite:///{tmp_path / 'sluice.db'}"),
        shared=SharedSettings(url=redis_url, prefix=prefix, lease_s=2.0),
    )

    def app() -> Any:
        backend = LocalEngineBackend({"demo": demo_model_dir}, {"max_num_seqs": 2, "kv_cache_bytes": 8 * 2**20})
        return create_app(settings, backend)

    async with (
        AsyncTestClient(app(), base_url="http://a.test") as a,
        AsyncTestClient(app(), base_url="http://b.test") as b,
    ):
        yield a, b, {"authorization": f"Bearer {admin_token}"}


async def new_key(client: AsyncTestClient[Any], admin: dict[str, str], **tenant: Any) -> tuple[str, str, str]:
    """(tenant id, key id, key) of a fresh tenant."""
    created = await client.post("/admin/tenants", json={"name": f"t-{secrets.token_hex(3)}", **tenant}, headers=admin)
    assert created.status_code == 201, created.text
    tenant_id = created.json()["id"]
    key = await client.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "k"}, headers=admin)
    assert key.status_code == 201, key.text
    return tenant_id, key.json()["id"], key.json()["key"]


async def until_status(client: AsyncTestClient[Any], key: str, status: int) -> float:
    """Seconds until GET /v1/models with `key` answers `status` (fails after PROPAGATION_S)."""
    start = time.monotonic()
    while True:
        answer = await client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
        if answer.status_code == status:
            return time.monotonic() - start
        assert time.monotonic() - start < PROPAGATION_S, f"still {answer.status_code}, expected {status}"
        await asyncio.sleep(0.02)


async def test_key_revoked_on_a_is_refused_by_b_within_a_second(two_replicas) -> None:
    a, b, admin = two_replicas
    tenant_id, key_id, key = await new_key(a, admin)
    assert (await b.get("/v1/models", headers={"authorization": f"Bearer {key}"})).status_code == 200  # cached on B
    revoked = await a.delete(f"/admin/tenants/{tenant_id}/keys/{key_id}", headers=admin)
    assert revoked.status_code == 200, revoked.text
    await until_status(b, key, 401)
    assert (await b.get("/ready")).json()["checks"]["shared"] is True
    refused = await b.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert refused.json()["error"]["code"] == "invalid_api_key"


async def test_tenant_disabled_and_quota_edited_on_a_reach_b(two_replicas) -> None:
    a, b, admin = two_replicas
    tenant_id, _, key = await new_key(a, admin, quotas={"requests_per_minute": 5})
    listed = await b.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert listed.headers["x-ratelimit-limit-requests"] == "5"
    edited = await a.patch(f"/admin/tenants/{tenant_id}/quotas", json={"requests_per_minute": 7}, headers=admin)
    assert edited.status_code == 200, edited.text
    start = time.monotonic()
    while (await b.get("/v1/models", headers={"authorization": f"Bearer {key}"})).headers.get(
        "x-ratelimit-limit-requests"
    ) != "7":
        assert time.monotonic() - start < PROPAGATION_S, "B still enforces the old quota"
        await asyncio.sleep(0.02)
    disabled = await a.patch(f"/admin/tenants/{tenant_id}", json={"enabled": False}, headers=admin)
    assert disabled.status_code == 200, disabled.text
    await until_status(b, key, 403)


async def test_requests_per_minute_holds_across_both_apps(two_replicas) -> None:
    a, b, admin = two_replicas
    _, _, key = await new_key(a, admin, quotas={"requests_per_minute": 3})
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 1}
    codes = []
    for client in (a, b, a, b, a):
        answer = await client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
        codes.append(answer.status_code)
    assert codes == [200, 200, 200, 429, 429]


async def test_a_finished_request_frees_its_slot_on_the_other_app_before_its_answer(two_replicas) -> None:
    a, b, admin = two_replicas
    _, _, key = await new_key(a, admin, quotas={"max_concurrent": 1})
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 2}
    for client, stream in ((a, False), (b, False), (a, True), (b, True), (a, False)):
        answer = await client.post("/v1/completions", json={**body, "stream": stream}, headers=headers)
        assert answer.status_code == 200, answer.text
        if stream:
            assert answer.text.rstrip().endswith("data: [DONE]")


async def test_tenant_objectives_edited_on_a_reach_b(two_replicas) -> None:
    a, b, admin = two_replicas
    tenant_id, _, key = await new_key(a, admin, priority_ceiling="interactive", default_class="interactive")
    auth = {"authorization": f"Bearer {key}"}
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    first = await b.post("/v1/chat/completions", json=body, headers=auth)  # B caches the tenant
    assert first.status_code == 200 and first.headers["x-sluice-objective"] == "ttft=3, itl=0.3", first.text
    edited = await a.patch(f"/admin/tenants/{tenant_id}", json={"itl_target_s": 0.15}, headers=admin)
    assert edited.status_code == 200, edited.text
    start = time.monotonic()
    while (await b.post("/v1/chat/completions", json=body, headers=auth)).headers["x-sluice-objective"] != \
            "ttft=3, itl=0.15":
        assert time.monotonic() - start < PROPAGATION_S * 5, "B still serves against the old target"
        await asyncio.sleep(0.05)
