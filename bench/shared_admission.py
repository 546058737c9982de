"""Admission latency of the quota ledger: in-process vs Redis, measured side by side in one run.

One QuotaService per ledger, the same tenant limits on both (every limit set, so every check runs);
the two are called alternately, request by request, so load on the machine hits both alike. One
admission is `QuotaService.admit` (for Redis: one Lua script round trip); the settlement after it is
timed too (`settle` + `flush`, i.e. until Redis has applied it). `--concurrency` admissions are
kept in flight per ledger (1: pure latency). Prints p50/p99 in microseconds and can write JSON.

`--postgres-url` adds a third arm, the floor of a PostgreSQL ledger: one conditional
`UPDATE ... WHERE live < limit RETURNING` per admission and one `UPDATE` per settlement on a
single counter row (a real ledger would need more: the windows, the day, the leases).

    PYTHONPATH=. python bench/shared_admission.py --redis-url redis://127.0.0.1:6379/0 --requests 2000 \
        --postgres-url postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
from redis.asyncio import Redis

from sluice.gateway.auth.service import TenantContext
from sluice.gateway.quotas.redis_ledger import RedisLedger
from sluice.gateway.quotas.service import QuotaLimits, QuotaService
from sluice.protocol import Priority
from sluice.telemetry import percentile

LIMITS = QuotaLimits(requests_per_minute=10**9, tokens_per_minute=10**12, tokens_per_day=10**15,
                     max_concurrent=10**6, max_queued=10**6)


async def _no_usage_yet(tenant_id: str, day: object) -> int:
    return 0


async def _one(quotas: QuotaService, tenant: TenantContext, admit_us: list[float], settle_us: list[float]) -> None:
    start = time.perf_counter()
    reservation = await quotas.admit(tenant, 100, 100, Priority.STANDARD)
    admitted = time.perf_counter()
    quotas.mark_running(reservation)
    quotas.settle(reservation, 100, 50)
    await quotas.flush()
    admit_us.append((admitted - start) * 1e6)
    settle_us.append((time.perf_counter() - admitted) * 1e6)


class PostgresFloor:
    """The least a PostgreSQL ledger does per admission: an atomic conditional update of one row."""

    def __init__(self, pool: asyncpg.Pool, table: str) -> None:
        self._pool, self._table = pool, table

    @classmethod
    async def open(cls, url: str, concurrency: int) -> PostgresFloor:
        pool = await asyncpg.create_pool(url, min_size=concurrency, max_size=concurrency)
        table = f"sluice_bench_{secrets.token_hex(4)}"
        await pool.execute(f"CREATE UNLOGGED TABLE {table} (tenant text PRIMARY KEY, live bigint, tokens bigint)")
        await pool.execute(f"INSERT INTO {table} VALUES ('bench', 0, 0)")
        return cls(pool, table)

    async def one(self, admit_us: list[float], settle_us: list[float]) -> None:
        start = time.perf_counter()
        row = await self._pool.fetchrow(
            f"UPDATE {self._table} SET live = live + 1, tokens = tokens + 200 "
            "WHERE tenant = 'bench' AND live < 1000000 RETURNING live")
        assert row is not None
        admitted = time.perf_counter()
        await self._pool.execute(
            f"UPDATE {self._table} SET live = live - 1, tokens = tokens - 50 WHERE tenant = 'bench'")
        admit_us.append((admitted - start) * 1e6)
        settle_us.append((time.perf_counter() - admitted) * 1e6)

    async def close(self) -> None:
        await self._pool.execute(f"DROP TABLE {self._table}")
        await self._pool.close()


async def measure(
    redis_url: str, requests: int, concurrency: int, postgres_url: str | None = None
) -> dict[str, dict[str, float]]:
    client = Redis.from_url(redis_url)
    prefix = f"sluice-bench-{secrets.token_hex(4)}"
    ledger = RedisLedger(client, prefix=prefix, lease_s=10.0)
    await ledger.start()
    services = {"in-process": QuotaService(_no_usage_yet), "redis": QuotaService(_no_usage_yet, ledger=ledger)}
    tenant = TenantContext(id="bench", name="bench", priority_ceiling=Priority.STANDARD,
                           default_class=Priority.STANDARD, weight=1.0, allowed_models=frozenset(),
                           enabled=True, limits=LIMITS)
    arms: dict[str, Callable[[list[float], list[float]], Awaitable[None]]] = {
        name: functools.partial(_one, quotas, tenant) for name, quotas in services.items()
    }
    floor = await PostgresFloor.open(postgres_url, concurrency) if postgres_url else None
    if floor is not None:
        arms["postgres-floor"] = floor.one
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in arms}
    try:
        for arm in arms.values():  # warm-up: day seeding, script loading, connections
            await arm([], [])
        for _ in range(max(1, requests // concurrency)):
            for name, arm in arms.items():
                admit_us, settle_us = samples[name]
                await asyncio.gather(*(arm(admit_us, settle_us) for _ in range(concurrency)))
    finally:
        if floor is not None:
            await floor.close()
        await ledger.stop()
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=500)]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    report: dict[str, dict[str, float]] = {}
    for name, (admit_us, settle_us) in samples.items():
        report[name] = {
            "requests": len(admit_us),
            "admit_p50_us": percentile(admit_us, 50) or 0.0,
            "admit_p99_us": percentile(admit_us, 99) or 0.0,
            "settle_p50_us": percentile(settle_us, 50) or 0.0,
            "settle_p99_us": percentile(settle_us, 99) or 0.0,
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--requests", type=int, default=2000, help="admissions per ledger")
    parser.add_argument("--concurrency", type=int, default=1, help="admissions in flight per ledger")
    parser.add_argument("--postgres-url", help="also time the PostgreSQL floor (asyncpg URL: postgresql://...)")
    parser.add_argument("--json", dest="json_out", help="write the figures here")
    args = parser.parse_args()
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be at least 1")
    report = asyncio.run(measure(args.redis_url, args.requests, args.concurrency, args.postgres_url))
    print(f"admission latency, {args.requests} requests per ledger, concurrency {args.concurrency} (microseconds)")
    print(f"{'ledger':<16}{'admit p50':>12}{'admit p99':>12}{'settle p50':>12}{'settle p99':>12}")
    for name, row in report.items():
        print(f"{name:<16}{row['admit_p50_us']:>12.0f}{row['admit_p99_us']:>12.0f}"
              f"{row['settle_p50_us']:>12.0f}{row['settle_p99_us']:>12.0f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"concurrency": args.concurrency, "ledgers": report}, indent=2))


if __name__ == "__main__":
    main()
