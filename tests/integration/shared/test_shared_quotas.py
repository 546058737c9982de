"""Quotas exact across replicas: three QuotaServices ("replicas"), each with its own Redis
connection and lease, share one tenant's limits through the Redis ledger."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.quotas.redis_ledger import RedisLedger
from sluice.gateway.quotas.service import QuotaExceeded, QuotaLimits, QuotaService, Reservation
from sluice.protocol import Priority

pytestmark = pytest.mark.integration

Make = Callable[..., Awaitable[list[tuple[QuotaService, RedisLedger]]]]


def tenant(tenant_id: str, **limits: int) -> TenantContext:
    return TenantContext(id=tenant_id, name=tenant_id, priority_ceiling=Priority.STANDARD,
                         default_class=Priority.STANDARD, weight=1.0, allowed_models=frozenset(), enabled=True,
                         limits=QuotaLimits(**limits))


async def try_admit(quotas: QuotaService, t: TenantContext, prompt: int = 1, out: int = 1) -> Reservation | str:
    """The reservation, or the refusal's code."""
    try:
        return await quotas.admit(t, prompt, out, Priority.STANDARD)
    except QuotaExceeded as exc:
        return exc.code or ""


async def test_requests_per_minute_exact_over_three_replicas(replicas: Make) -> None:
    three = await replicas(3)
    t = tenant("rpm", requests_per_minute=60)
    outcomes = await asyncio.gather(*(try_admit(three[i % 3][0], t) for i in range(200)))
    admitted = [o for o in outcomes if isinstance(o, Reservation)]
    assert len(admitted) == 60
    assert [o for o in outcomes if not isinstance(o, Reservation)] == ["rate_limit_exceeded"] * 140
    for index, reservation in enumerate(admitted):  # settling does not give the minute's requests back
        three[index % 3][0].settle(reservation, 1, 1)
    for quotas, _ in three:
        await quotas.flush()
    assert await try_admit(three[1][0], t) == "rate_limit_exceeded"
    assert three[2][0].headers(t)["x-ratelimit-remaining-requests"] == "0"


async def test_concurrency_never_above_the_limit_across_replicas(replicas: Make) -> None:
    three = await replicas(3)
    t = tenant("conc", max_concurrent=4)
    held, most, admitted = 0, 0, 0

    async def client(quotas: QuotaService) -> None:
        nonlocal held, most, admitted
        for _ in range(15):
            outcome = await try_admit(quotas, t)
            if isinstance(outcome, Reservation):
                held += 1
                admitted += 1
                most = max(most, held)
                await asyncio.sleep(0.01)
                held -= 1  # before the settlement reaches Redis: Redis never holds fewer than this
                quotas.settle(outcome, 1, 1)
            else:
                assert outcome == "rate_limit_exceeded"
                await asyncio.sleep(0.002)

    await asyncio.gather(*(client(three[i % 3][0]) for i in range(12)))
    assert most == 4  # reached, never passed
    assert admitted >= 4
    for quotas, _ in three:
        await quotas.flush()
    assert sum(quotas.live("conc")[0] for quotas, _ in three) == 0
    # every slot came back: four admissions at once succeed again
    again = [await try_admit(three[i % 3][0], t) for i in range(5)]
    assert [isinstance(o, Reservation) for o in again] == [True, True, True, True, False]


async def test_tokens_per_minute_reservation_settles_to_real_usage(replicas: Make) -> None:
    a, b, c = (quotas for quotas, _ in await replicas(3))
    t = tenant("tpm", tokens_per_minute=1000)
    first = await a.admit(t, 10, 490, Priority.STANDARD)  # 500 reserved
    await b.admit(t, 10, 490, Priority.STANDARD)  # 1000 reserved
    assert await try_admit(c, t, 10, 10) == "rate_limit_exceeded"
    a.settle(first, 10, 5)  # it used 15: 485 come back, on every replica
    await a.flush()
    await c.admit(t, 10, 400, Priority.STANDARD)  # 515 + 410 = 925
    assert c.headers(t)["x-ratelimit-remaining-tokens"] == "75"
    assert await try_admit(c, t, 10, 70) == "rate_limit_exceeded"  # 925 + 80 > 1000
    refused = await try_admit(b, t, 60, 960)
    assert refused == "request_too_large"  # above the minute's limit on its own: never admitted


async def test_killed_replica_releases_its_holds_within_the_lease(replicas: Make, lease_s: float) -> None:
    (victim, victim_ledger), (survivor, _) = await replicas(2)
    t = tenant("killed", max_concurrent=2, tokens_per_minute=1000)
    for _ in range(2):
        await victim.admit(t, 10, 290, Priority.STANDARD)  # 2 slots, 600 tokens held; never settled
    assert await try_admit(survivor, t) == "rate_limit_exceeded"
    await victim_ledger.stop_renewing()  # killed: no renewal, no settlement, nothing released
    killed_at = time.monotonic()
    assert await try_admit(survivor, t) == "rate_limit_exceeded"  # its lease still runs
    while True:
        outcome = await try_admit(survivor, t, 10, 690)  # 700: fits only once the 600 are refunded
        if isinstance(outcome, Reservation):
            break
        assert outcome == "rate_limit_exceeded"
        assert time.monotonic() - killed_at < 3 * lease_s, "the dead replica's holds were not released"
        await asyncio.sleep(0.05)
    assert survivor.live("killed") == (1, 1)
    assert isinstance(await try_admit(survivor, t, 10, 290), Reservation)  # 700 + 300: the last slot
    assert await try_admit(survivor, t) == "rate_limit_exceeded"


VICTIM = """
import asyncio, sys
from redis.asyncio import Redis
from sluice.gateway.auth.service import TenantContext
from sluice.gateway.quotas.service import QuotaLimits, QuotaService
from sluice.gateway.quotas.redis_ledger import RedisLedger
from sluice.protocol import Priority

async def main(url, prefix, lease_s):
    ledger = RedisLedger(Redis.from_url(url), prefix=prefix, lease_s=float(lease_s), replica="victim")
    await ledger.start()
    quotas = QuotaService(ledger=ledger)
    t = TenantContext(id="sigkill", name="sigkill", priority_ceiling=Priority.STANDARD,
                      default_class=Priority.STANDARD, weight=1.0, allowed_models=frozenset(), enabled=True,
                      limits=QuotaLimits(max_concurrent=2, tokens_per_minute=1000))
    for _ in range(2):
        await quotas.admit(t, 10, 290, Priority.STANDARD)
    print("held", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:]))
"""


async def test_sigkilled_replica_process_releases_its_holds_within_the_lease(
    replicas: Make, redis_url: str, prefix: str, lease_s: float
) -> None:
    (survivor, _), = await replicas(1)
    t = tenant("sigkill", max_concurrent=2, tokens_per_minute=1000)
    root = Path(__file__).resolve().parents[3]
    victim = await asyncio.create_subprocess_exec(
        sys.executable, "-c", VICTIM, redis_url, prefix, str(lease_s),
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(root / "src")},
    )
    try:
        assert victim.stdout is not None
        assert await asyncio.wait_for(victim.stdout.readline(), 60) == b"held\n"
        assert await try_admit(survivor, t) == "rate_limit_exceeded"  # both slots held by the victim
        os.kill(victim.pid, signal.SIGKILL)
        await victim.wait()
        killed_at = time.monotonic()
        while not isinstance(outcome := await try_admit(survivor, t, 10, 690), Reservation):
            assert outcome == "rate_limit_exceeded"
            assert time.monotonic() - killed_at < 3 * lease_s, "the killed replica's holds were not released"
            await asyncio.sleep(0.05)
        assert isinstance(await try_admit(survivor, t, 10, 290), Reservation)  # 700 + 300 tokens, 2 slots
    finally:
        if victim.returncode is None:
            victim.kill()
            await victim.wait()


async def test_an_admission_cancelled_in_flight_leaves_no_hold(replicas: Make) -> None:
    (a, a_ledger), (b, _) = await replicas(2)
    t = tenant("cancelled", max_concurrent=1)
    for delay in (0.0, 0.0002, 0.0005, 0.001, 0.002, 0.005):  # before sending, while Redis runs it, after
        task = asyncio.ensure_future(a.admit(t, 1, 1, Priority.STANDARD))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            a.release(await task)  # it completed before the cancellation: an ordinary admission
        await a.flush()
        await a_ledger.refresh()  # an admission whose answer was lost is ended at the next renewal
        taken = await try_admit(b, t)
        assert isinstance(taken, Reservation), f"a hold leaked (cancelled after {delay}s)"
        b.release(taken)
        await b.flush()


async def test_daily_budget_is_seeded_from_the_database_once_for_all_replicas(replicas: Make) -> None:
    calls: list[dt.date] = []

    async def loader(tenant_id: str, day: dt.date) -> int:
        calls.append(day)
        return 900

    (a, _), (b, _) = await replicas(2, loader)
    t = tenant("day", tokens_per_day=1000)
    first = await a.admit(t, 40, 40, Priority.STANDARD)  # 900 used + 80 reserved
    await b.admit(t, 10, 10, Priority.STANDARD)  # exactly the 20 left
    assert await try_admit(b, t, 1, 0) == "insufficient_quota"
    a.settle(first, 40, 10)  # 30 of the reservation come back
    await a.flush()
    await b.admit(t, 20, 10, Priority.STANDARD)
    assert len(calls) == 1


async def test_same_answers_as_in_process(replicas: Make) -> None:
    """The reservation / settle / refund sequence of the in-process unit test, on both ledgers."""
    (shared, _), = await replicas(1)

    async def scenario(quotas: QuotaService) -> list[object]:
        t = tenant("parity", tokens_per_minute=100, max_queued=2)
        seen: list[object] = []
        first = await quotas.admit(t, 10, 50, Priority.STANDARD)
        seen.append(await try_admit(quotas, t, 10, 40))
        quotas.settle(first, 10, 5)
        await quotas.flush()
        seen.append(quotas.headers(t)["x-ratelimit-remaining-tokens"])
        second = await quotas.admit(t, 10, 40, Priority.STANDARD)
        third = await quotas.admit(t, 1, 1, Priority.STANDARD)
        seen.append(await try_admit(quotas, t, 1, 1))  # two queued
        quotas.mark_running(third)
        await quotas.flush()
        seen.append(quotas.live("parity"))
        fourth = await quotas.admit(t, 1, 1, Priority.STANDARD)
        for reservation in (second, second, third, fourth):  # release is idempotent
            quotas.release(reservation)
        await quotas.flush()
        seen.append(quotas.headers(t)["x-ratelimit-remaining-tokens"])
        seen.append(quotas.live("parity"))
        return seen

    expected = ["rate_limit_exceeded", "85", "rate_limit_exceeded", (2, 1), "85", (0, 0)]
    assert await scenario(QuotaService()) == expected
    assert await scenario(shared) == expected


async def test_unreachable_redis_fails_closed_with_a_503() -> None:
    client = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)
    ledger = RedisLedger(client, prefix="sluice-unreachable", lease_s=1.0)
    await ledger.start()  # logs, does not raise: the gateway starts and answers 503 meanwhile
    try:
        with pytest.raises(OpenAIError) as caught:
            await QuotaService(ledger=ledger).admit(tenant("down"), 1, 1, Priority.STANDARD)
        assert caught.value.status == 503 and caught.value.code == "service_unavailable"
        assert caught.value.headers["retry-after"] == "1"
    finally:
        await ledger.stop()
        await client.aclose()
