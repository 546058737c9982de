"""Issue #36 item 15: two deployments (each its own database) on one Redis. With the same prefix
the second refuses to start, in one line naming the setting to change, instead of sharing the
first one's worker-room, fairness and lease counters; with a prefix each, or on another Redis
database number, both run and hear only their own announcements (pub/sub ignores the number).
Replicas of one deployment (one database) share the prefix as before (test_shared_gateways.py)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from sluice.errors import ConfigError
from sluice.gateway.app import create_app
from sluice.gateway.cluster.invalidation import Change
from sluice.gateway.queueing.local import LocalEngineBackend
from sluice.settings import AdminSettings, DatabaseSettings, Settings, SharedSettings
from sluice_lab.experiments.cluster import drop_redis_prefix

pytestmark = pytest.mark.integration

LEASE_S = 1.0  # the claim expires 3 s after its deployment's last replica stopped


@pytest.fixture
def deployment(demo_model_dir: Path, tmp_path: Path) -> Callable[..., AsyncTestClient[Any]]:
    """`deployment(name, redis_url, prefix)`: a gateway app of deployment `name` (its own database)."""

    def make(name: str, redis_url: str, prefix: str) -> AsyncTestClient[Any]:
        settings = Settings(
            admin=AdminSettings(token="slc-admin-" + secrets.token_urlsafe(32), demo_tenant=""),
            database=DatabaseSettings(url=f"sqlite+aiosqlite:///{tmp_path / name / 'sluice.db'}"),
            shared=SharedSettings(url=redis_url, prefix=prefix, lease_s=LEASE_S),
        )
        backend = LocalEngineBackend({"demo": demo_model_dir}, {"max_num_seqs": 2, "kv_cache_bytes": 8 * 2**20})
        return AsyncTestClient(create_app(settings, backend))

    return make


async def _start_error(client: AsyncTestClient[Any]) -> ConfigError | None:
    """The one-line error a start under another deployment's prefix fails with (None: it started)."""
    try:
        async with client:
            return None
    except BaseExceptionGroup as group:  # the lifespan's task group wraps it
        found = group.subgroup(ConfigError)
        if found is None:
            raise
        return found.exceptions[0]  # type: ignore[return-value]


async def _refused(client: AsyncTestClient[Any]) -> str:
    error = await _start_error(client)
    assert error is not None, "it started"
    return str(error)


async def test_a_second_deployment_on_the_same_prefix_refuses_to_start(deployment, redis_url: str,
                                                                       prefix: str) -> None:
    async with deployment("one", redis_url, prefix) as one, deployment("one", redis_url, prefix) as replica:
        assert (await one.get("/ready")).status_code == 200
        assert (await replica.get("/ready")).status_code == 200  # a replica of the same deployment: welcome
        refused = deployment("two", redis_url, prefix)
        message = await _refused(refused)
        assert refused.app.state.services.shared.refused is not None  # what `sluice serve` ends with
        assert "SLUICE_SHARED_PREFIX" in message and prefix in message and "\n" not in message
        assert redis_url not in message  # the URL may hold a password
        async with deployment("two", redis_url, f"{prefix}-two") as two:  # the fix the message names
            assert (await two.get("/ready")).json()["checks"]["shared"] is True
        assert (await one.get("/ready")).status_code == 200  # the refused start disturbed nothing


async def test_the_prefix_is_given_up_once_its_deployment_is_gone(deployment, redis_url: str, prefix: str) -> None:
    async with deployment("one", redis_url, prefix):
        pass
    # Within the claim's expiry (3 leases) the prefix frees; the loop's bound only stops a hang.
    for _ in range(100):
        if await _start_error(deployment("two", redis_url, prefix)) is None:
            return
        await asyncio.sleep(0.2)
    pytest.fail("the prefix stayed claimed after its deployment stopped")


@pytest.fixture
async def other_database(redis_url: str, prefix: str) -> AsyncIterator[str]:
    """The same Redis, the next database number (cleaned afterwards)."""
    base, _, number = redis_url.rpartition("/")
    url = f"{base}/{(int(number or 0) + 1) % 16}" if number.isdigit() else f"{redis_url.rstrip('/')}/1"
    yield url
    await drop_redis_prefix(url, prefix)


async def test_deployments_on_two_database_numbers_do_not_hear_each_other(deployment, redis_url: str, prefix: str,
                                                                          other_database: str) -> None:
    async with deployment("one", redis_url, prefix) as one, deployment("two", other_database, prefix) as two:
        heard: list[Change] = []  # the handlers run on each app's own loop; a list append is safe
        two.app.state.services.shared.bus.subscribe(heard.append)
        mine: list[Change] = []
        one.app.state.services.shared.bus.subscribe(mine.append)
        admin = {"authorization": f"Bearer {one.app.state.services.settings.admin.token}"}
        tenant = await one.post("/admin/tenants", json={"name": "t"}, headers=admin)
        assert (await one.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={"name": "k"},
                               headers=admin)).status_code == 201
        assert {c.kind for c in mine} == {"key_created"}  # announced (and heard back) on one's channel
        # Deployment two on one's channel would have heard it within milliseconds; a marker
        # published on two's own channel afterwards bounds the wait.
        publisher = Redis.from_url(other_database)
        await publisher.publish(two.app.state.services.shared.bus.channel, b'{"kind":"tenant","ident":"marker"}')
        await publisher.aclose()
        for _ in range(500):
            if heard:
                break
            await asyncio.sleep(0.01)
        assert heard == [Change("tenant", "marker")]
