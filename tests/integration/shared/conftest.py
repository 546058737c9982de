"""The shared store: the real Redis named by $SLUICE_TEST_REDIS_URL (.ci/run sets it when
127.0.0.1:6379 answers). Without it the tests are skipped, except under CI=true, where that is a
failure. Each test gets its own key prefix and removes its keys afterwards."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from redis.asyncio import Redis

from sluice.gateway.quotas.redis_ledger import RedisLedger
from sluice.gateway.quotas.service import QuotaService

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "")
LEASE_S = 1.5  # short, so a killed replica's holds come back within the test


@pytest.fixture
def lease_s() -> float:
    return LEASE_S


@pytest.fixture
def redis_url() -> str:
    if not REDIS_URL:
        if os.environ.get("CI") == "true":
            pytest.fail("SLUICE_TEST_REDIS_URL is not set: under CI=true the shared-state tests must run "
                        "(.ci/run starts Debian's redis-server when 127.0.0.1:6379 does not answer)")
        pytest.skip("SLUICE_TEST_REDIS_URL is not set (e.g. redis://127.0.0.1:6379/0); no shared store to test")
    return REDIS_URL


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    try:
        await client.ping()
    except OSError as exc:
        pytest.fail(f"SLUICE_TEST_REDIS_URL={redis_url} does not answer: {exc}")
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis: Redis) -> AsyncIterator[str]:
    name = f"sluice-test-{secrets.token_hex(6)}"
    yield name
    keys = [key async for key in redis.scan_iter(match=f"{name}:*", count=500)]
    if keys:
        await redis.delete(*keys)


Replica = tuple[QuotaService, RedisLedger]


@pytest.fixture
async def replicas(
    redis_url: str, prefix: str
) -> AsyncIterator[Callable[..., Awaitable[list[Replica]]]]:
    """`await replicas(n, day_loader=None)`: n QuotaServices, each with its own client and lease."""
    made: list[tuple[RedisLedger, Redis]] = []

    async def make(count: int, day_loader: Callable[..., Awaitable[int]] | None = None) -> list[Replica]:
        out: list[Replica] = []
        for index in range(count):
            client = Redis.from_url(redis_url)
            ledger = RedisLedger(client, prefix=prefix, lease_s=LEASE_S, replica=f"replica-{index}")
            await ledger.start()
            made.append((ledger, client))
            out.append((QuotaService(day_loader, ledger=ledger), ledger))
        return out

    yield make
    for ledger, client in made:
        await ledger.stop()
        await client.aclose()
