"""QuotaService: windows, reservations, settle/refund, daily budget, concurrency (a driven clock)."""

from __future__ import annotations

import datetime as dt

import pytest

from sluice.gateway.auth.service import TenantContext, generate_key, hash_secret
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.generation.prepare import resolve_priority
from sluice.gateway.quotas.service import QuotaExceeded, QuotaLimits, QuotaService, format_reset
from sluice.protocol import Priority

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tenant(
    tenant_id: str = "t1",
    *,
    ceiling: Priority = Priority.STANDARD,
    default: Priority = Priority.STANDARD,
    **limits: int | None,
) -> TenantContext:
    return TenantContext(
        id=tenant_id,
        name=tenant_id,
        priority_ceiling=ceiling,
        default_class=default,
        weight=1.0,
        allowed_models=frozenset(),
        enabled=True,
        limits=QuotaLimits(**limits),
    )


async def test_requests_per_minute_sliding_window() -> None:
    clock = Clock()
    quotas = QuotaService(clock=clock)
    t = tenant(requests_per_minute=3)
    for _ in range(3):
        quotas.settle(await quotas.admit(t, 5, 5, Priority.STANDARD), 5, 5)
        clock.now += 10
    with pytest.raises(QuotaExceeded) as exc:
        await quotas.admit(t, 5, 5, Priority.STANDARD)
    assert exc.value.status == 429 and exc.value.code == "rate_limit_exceeded"
    assert exc.value.retry_after == 30  # the first admission (t=1000) leaves the window at t=1060
    assert exc.value.headers["retry-after"] == "30"
    assert exc.value.headers["x-ratelimit-remaining-requests"] == "0"
    clock.now += 30
    await quotas.admit(t, 5, 5, Priority.STANDARD)


async def test_tokens_per_minute_reserve_settle_and_refund() -> None:
    clock = Clock()
    quotas = QuotaService(clock=clock)
    t = tenant(tokens_per_minute=100)
    first = await quotas.admit(t, 10, 50, Priority.STANDARD)  # reserves 60
    with pytest.raises(QuotaExceeded):
        await quotas.admit(t, 10, 40, Priority.STANDARD)  # 60 + 50 > 100
    quotas.settle(first, 10, 5)  # used 15: 45 come back
    assert quotas.headers(t)["x-ratelimit-remaining-tokens"] == "85"
    second = await quotas.admit(t, 10, 40, Priority.STANDARD)
    quotas.release(second)  # never ran: full refund
    quotas.release(second)  # idempotent
    assert quotas.headers(t)["x-ratelimit-remaining-tokens"] == "85"
    with pytest.raises(QuotaExceeded) as too_big:
        await quotas.admit(t, 60, 60, Priority.STANDARD)
    assert "Request too large" in too_big.value.message and "never" in too_big.value.message
    # It can never succeed, so no SDK may retry it: 429 with x-should-retry false, no retry-after.
    assert too_big.value.status == 429 and too_big.value.code == "request_too_large"
    assert too_big.value.param == "max_tokens"
    assert too_big.value.headers["x-should-retry"] == "false" and "retry-after" not in too_big.value.headers
    clock.now += 61
    assert quotas.headers(t)["x-ratelimit-remaining-tokens"] == "100"


async def test_daily_budget_reads_database_total_once() -> None:
    calls: list[dt.date] = []

    async def loader(tenant_id: str, day: dt.date) -> int:
        calls.append(day)
        return 900

    quotas = QuotaService(loader)
    t = tenant(tokens_per_day=1000)
    r = await quotas.admit(t, 40, 40, Priority.STANDARD)
    quotas.settle(r, 40, 10)  # 950 used
    with pytest.raises(QuotaExceeded) as exc:
        await quotas.admit(t, 40, 20, Priority.STANDARD)
    assert exc.value.code == "insufficient_quota" and exc.value.headers["x-should-retry"] == "false"
    assert "retry-after" not in exc.value.headers
    await quotas.admit(t, 30, 20, Priority.STANDARD)  # exactly the 50 left
    assert len(calls) == 1


async def test_concurrency_counts_queued_and_running() -> None:
    quotas = QuotaService()
    t = tenant(max_concurrent=2, max_queued=1)
    a = await quotas.admit(t, 1, 1, Priority.STANDARD)
    with pytest.raises(QuotaExceeded, match="queued"):
        await quotas.admit(t, 1, 1, Priority.STANDARD)
    quotas.mark_running(a)
    b = await quotas.admit(t, 1, 1, Priority.STANDARD)
    quotas.mark_running(b)
    with pytest.raises(QuotaExceeded, match="concurrent") as exc:
        await quotas.admit(t, 1, 1, Priority.STANDARD)
    assert 1 <= exc.value.retry_after <= 60
    quotas.settle(a, 1, 1)
    await quotas.admit(t, 1, 1, Priority.STANDARD)
    assert quotas.live("t1") == (2, 1)


async def test_per_request_caps_are_400() -> None:
    quotas = QuotaService()
    t = tenant(max_prompt_tokens=10, max_output_tokens=5)
    with pytest.raises(OpenAIError) as prompt:
        await quotas.admit(t, 11, 1, Priority.STANDARD)
    assert prompt.value.status == 400 and prompt.value.code == "context_length_exceeded"
    with pytest.raises(OpenAIError) as output:
        await quotas.admit(t, 1, 6, Priority.STANDARD)
    assert output.value.status == 400 and output.value.param == "max_tokens"


def test_priority_is_capped_by_ceiling() -> None:
    batch_only = tenant("b", ceiling=Priority.BATCH, default=Priority.BATCH)
    assert resolve_priority(batch_only, "priority") is Priority.BATCH
    vip = tenant("v", ceiling=Priority.INTERACTIVE, default=Priority.STANDARD)
    assert resolve_priority(vip, "priority") is Priority.INTERACTIVE
    assert resolve_priority(vip, None) is Priority.STANDARD
    assert resolve_priority(vip, "flex") is Priority.BATCH
    with pytest.raises(OpenAIError):
        resolve_priority(vip, "turbo")


def test_keys_and_reset_format() -> None:
    key, prefix, digest = generate_key()
    assert key.startswith(prefix) and len(key) > 40 and digest == hash_secret(key) and len(digest) == 64
    assert generate_key()[0] != key
    assert format_reset(0.5) == "500ms" and format_reset(12) == "12s" and format_reset(60) == "1m0s"
