"""Admin, auth, usage and seeding services against a migrated database (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import pytest
from sqlalchemy import select

from sluice.gateway.admin.schemas import KeyCreate, Quotas, QuotasPatch, TenantCreate, TenantPatch
from sluice.gateway.admin.seed import ensure_demo_key, seed_tenants
from sluice.gateway.admin.service import AdminService
from sluice.gateway.auth.service import UNKNOWN_KEY_CACHE_SIZE, AuthService, hash_secret
from sluice.gateway.db.migrate import migrate
from sluice.gateway.db.models import AdminToken, ApiKey, AuditLog, UsageDaily
from sluice.gateway.db.session import make_engine, make_session_factory
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.quotas.usage import UsageService
from sluice.settings import QuotaSeed, TenantSeed

pytestmark = pytest.mark.integration


@pytest.fixture
async def services(database_url: str):
    await migrate(database_url)
    engine = make_engine(database_url)
    sessions = make_session_factory(engine)
    auth = AuthService(sessions, cache_ttl_s=300.0)
    usage = UsageService(sessions)
    yield sessions, auth, AdminService(sessions, auth, usage.flush), usage
    await auth.drain()
    await engine.dispose()


async def test_tenant_key_lifecycle(services) -> None:
    sessions, auth, admin, _ = services
    tenant = await admin.create_tenant(
        TenantCreate(name="acme", priority_ceiling="interactive", quotas=Quotas(requests_per_minute=5))
    )
    assert tenant.quotas.requests_per_minute == 5
    with pytest.raises(OpenAIError) as dup:
        await admin.create_tenant(TenantCreate(name="acme"))
    assert dup.value.status == 409
    created = await admin.create_key(tenant.id, KeyCreate(name="app"))
    assert created.key.startswith("sk-slc-") and created.key.startswith(created.prefix)

    # Stored: only the SHA-256 hash, never the key.
    async with sessions() as session:
        row = await session.scalar(select(ApiKey).where(ApiKey.id == created.id))
    assert row.hash == hash_secret(created.key) and created.key not in (row.hash, row.prefix)

    context = await auth.authenticate(created.key)
    assert context.id == tenant.id and context.limits.requests_per_minute == 5
    # A quota change is visible on the next authentication (cache evicted in-process).
    await admin.update_quotas(tenant.id, QuotasPatch(requests_per_minute=None, tokens_per_day=1000))
    context = await auth.authenticate(created.key)
    assert context.limits.requests_per_minute is None and context.limits.tokens_per_day == 1000

    # Revoke fails at once, even though the cache TTL is long.
    await admin.revoke_key(tenant.id, created.id)
    with pytest.raises(OpenAIError) as revoked:
        await auth.authenticate(created.key)
    assert revoked.value.status == 401

    rotated_from = await admin.create_key(tenant.id, KeyCreate())
    await auth.authenticate(rotated_from.key)
    rotated = await admin.rotate_key(tenant.id, rotated_from.id)
    assert (await auth.authenticate(rotated.key)).id == tenant.id
    with pytest.raises(OpenAIError):
        await auth.authenticate(rotated_from.key)

    # Expiry in the past is refused; an expired key stops working at once.
    with pytest.raises(OpenAIError):
        await admin.create_key(tenant.id, KeyCreate(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(1)))
    soon = await admin.create_key(
        tenant.id, KeyCreate(expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1))
    )
    await auth.authenticate(soon.key)
    async with sessions() as session, session.begin():
        key = await session.get(ApiKey, soon.id)
        key.expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    auth.invalidate_key(soon.id)
    with pytest.raises(OpenAIError):
        await auth.authenticate(soon.key)

    # Disabling the tenant blocks its keys at once.
    await admin.update_tenant(tenant.id, TenantPatch(enabled=False))
    with pytest.raises(OpenAIError) as disabled:
        await auth.authenticate(rotated.key)
    assert disabled.value.status == 403

    actions = [a.action for a in await admin.audit()]
    assert {
        "tenant.create",
        "key.create",
        "key.revoke",
        "key.rotate",
        "quota.update",
        "tenant.update",
    } <= set(actions)
    async with sessions() as session:
        details = [r.details for r in (await session.execute(select(AuditLog))).scalars()]
    assert not any(k in str(details) for k in (created.key, rotated.key, soon.key))


async def test_delete_disables_when_usage_exists(services) -> None:
    _, _, admin, usage = services
    unused = await admin.create_tenant(TenantCreate(name="unused"))
    result = await admin.delete_tenant(unused.id)
    assert result.deleted and not result.disabled
    with pytest.raises(OpenAIError):
        await admin.get_tenant(unused.id)

    used = await admin.create_tenant(TenantCreate(name="used"))
    await usage.record("used-1", used.id, "demo", 10, 5)
    await usage.record("used-2", used.id, "demo", 1, 2)
    result = await admin.delete_tenant(used.id)
    assert result.disabled and not result.deleted
    assert not (await admin.get_tenant(used.id)).enabled
    rows = await usage.query(used.id, None, None)
    assert [(r.prompt_tokens, r.completion_tokens, r.requests) for r in rows] == [(11, 7, 2)]
    assert await usage.day_total(used.id, dt.datetime.now(dt.UTC).date()) == 18


async def test_seed_is_idempotent_and_admin_token_hashed(services) -> None:
    sessions, auth, admin, _ = services
    seeds = [
        TenantSeed(
            name="chat",
            priority_ceiling="interactive",
            default_class="interactive",
            quotas=QuotaSeed(tokens_per_minute=1000),
        ),
        TenantSeed(name="nightly", priority_ceiling="batch", default_class="batch"),
    ]
    await seed_tenants(admin, seeds)
    await seed_tenants(admin, seeds)  # idempotent, and never creates a key
    first = await ensure_demo_key(admin, "chat", ttl_days=7)
    assert first is not None and first.key is not None and first.key.startswith("sk-slc-")
    assert first.expires_at is not None
    again = await ensure_demo_key(admin, "chat", ttl_days=7)  # a live demo key exists: nothing new
    assert again is not None and again.key is None and again.prefix == first.prefix
    renewed = await ensure_demo_key(admin, "chat", ttl_days=7, renew=True)
    assert renewed is not None and renewed.key is not None
    keys = await admin.list_keys(first.tenant_id)
    assert len([k for k in keys if k.revoked_at is None]) == 1  # the previous demo key is revoked
    with pytest.raises(OpenAIError):
        await auth.authenticate(first.key)
    assert (await auth.authenticate(renewed.key)).id == first.tenant_id
    assert await ensure_demo_key(admin, "nobody", ttl_days=7) is None
    tenants = await admin.list_tenants()
    assert sorted(t.name for t in tenants) == ["chat", "nightly"]
    assert next(t for t in tenants if t.name == "chat").quotas.tokens_per_minute == 1000

    generated = await auth.ensure_admin_token()
    assert generated is not None and auth.verify_admin(generated)
    assert await auth.ensure_admin_token() is None  # not generated twice
    async with sessions() as session:
        stored = list((await session.execute(select(AdminToken.hash))).scalars())
    assert stored == [hash_secret(generated)]
    assert not auth.verify_admin("slc-admin-wrong")


async def test_a_configured_admin_token_is_the_only_one_and_dies_when_unset(services) -> None:
    sessions, auth, _, _ = services
    generated = await auth.ensure_admin_token()  # first start without SLUICE_ADMIN_TOKEN
    assert generated is not None
    configured = "slc-admin-configured-" + "c" * 24
    assert await auth.ensure_admin_token(configured) is None  # a start with SLUICE_ADMIN_TOKEN set
    assert auth.verify_admin(configured) and not auth.verify_admin(generated)
    changed = "slc-admin-changed-" + "d" * 24
    await auth.ensure_admin_token(changed)  # a start with another value
    assert auth.verify_admin(changed) and not auth.verify_admin(configured)
    fresh = await auth.ensure_admin_token()  # a start with it unset: neither old token survives
    assert fresh is not None and auth.verify_admin(fresh)
    assert not auth.verify_admin(configured) and not auth.verify_admin(changed)
    assert not auth.verify_admin(generated)
    async with sessions() as session:
        stored = list((await session.execute(select(AdminToken.hash))).scalars())
    assert stored == [hash_secret(fresh)]


async def test_unknown_keys_are_cached_briefly_and_forgotten_when_created(services, monkeypatch) -> None:
    _, auth, admin, _ = services
    tenant = await admin.create_tenant(TenantCreate(name="negative"))
    queries = 0
    real = auth._sessions

    def counting():
        nonlocal queries
        queries += 1
        return real()

    monkeypatch.setattr(auth, "_sessions", counting)
    for _ in range(20):
        with pytest.raises(OpenAIError):
            await auth.authenticate("sk-slc-not-a-key")
    assert queries == 1  # one database lookup for 20 tries of the same unknown key
    created = await admin.create_key(tenant.id, KeyCreate(name="new"))
    with pytest.raises(OpenAIError):
        await auth.authenticate(created.key + "x")
    assert (await auth.authenticate(created.key)).id == tenant.id
    # A hash remembered as unknown is forgotten when a key with it is created (the only way to
    # provoke that is by hand: new keys are random), and the cache stays bounded.
    auth._remember_unknown(hash_secret("sk-slc-future"), time.monotonic())
    auth.key_created(hash_secret("sk-slc-future"))
    assert hash_secret("sk-slc-future") not in auth._unknown
    for i in range(UNKNOWN_KEY_CACHE_SIZE + 50):
        auth._remember_unknown(f"{i:064x}", 0.0)
    assert len(auth._unknown) == UNKNOWN_KEY_CACHE_SIZE


async def test_daily_budget_survives_restart(services) -> None:
    """A fresh QuotaService (a restarted gateway) starts from the day's total in usage_daily."""
    from sluice.gateway.auth.service import tenant_context
    from sluice.gateway.db.models import Quota, Tenant
    from sluice.gateway.quotas.service import QuotaExceeded, QuotaService
    from sluice.protocol import Priority

    sessions, _, admin, usage = services
    created = await admin.create_tenant(TenantCreate(name="budget", quotas=Quotas(tokens_per_day=100)))
    async with sessions() as session:
        context = tenant_context(await session.get(Tenant, created.id), await session.get(Quota, created.id))
    first = QuotaService(usage.day_total)
    reservation = await first.admit(context, 30, 30, Priority.STANDARD)
    first.settle(reservation, 30, 30)
    await usage.record("created-1", created.id, "demo", 30, 30)

    restarted = QuotaService(usage.day_total)
    with pytest.raises(QuotaExceeded) as exc:
        await restarted.admit(context, 30, 20, Priority.STANDARD)  # 60 used + 50 > 100
    assert exc.value.code == "insufficient_quota"
    await restarted.admit(context, 20, 20, Priority.STANDARD)


async def test_usage_is_written_behind_in_one_row_per_day(services) -> None:
    """On a quiet service a record is flushed at once (with what was recorded beside it); within
    an interval of that flush the next records wait for the interval and go in one upsert; close()
    writes the rest."""
    sessions, _, admin, _ = services
    usage = UsageService(sessions, flush_interval_s=3.0)
    tenant = await admin.create_tenant(TenantCreate(name="written-behind"))

    async def stored() -> list[tuple[int, int, int]]:
        async with sessions() as session:
            rows = (await session.execute(select(UsageDaily).where(UsageDaily.tenant_id == tenant.id))).scalars()
            return [(r.prompt_tokens, r.completion_tokens, r.requests) for r in rows]

    first = usage.record("r1", tenant.id, "demo", 3, 4)
    second = usage.record("r2", tenant.id, "demo", 1, 1)
    await asyncio.wait_for(asyncio.gather(first, second), 2.5)  # not held for the interval
    assert await stored() == [(4, 5, 2)]
    third = usage.record("r3", tenant.id, "demo", 10, 0)
    fourth = usage.record("r4", tenant.id, "demo", 0, 2)
    await asyncio.sleep(0.1)
    assert not third.done() and await stored() == [(4, 5, 2)]  # the last flush is recent: it waits
    await asyncio.gather(third, fourth)
    assert await stored() == [(14, 7, 4)]
    last = usage.record("r5", tenant.id, "demo", 0, 1)
    await usage.close()
    assert last.done()
    assert await stored() == [(14, 8, 5)]


async def test_a_request_recorded_twice_counts_once(services) -> None:
    """A stream's usage is recorded by its replica and again by the replica that took it over
    (streams/resumer.py); two processes, one database: the id counts once, in one flush or two."""
    sessions, _, admin, _ = services
    tenant = await admin.create_tenant(TenantCreate(name="recorded-twice"))
    lost, taker = UsageService(sessions), UsageService(sessions)
    await lost.record("chatcmpl-1", tenant.id, "demo", 7, 40)
    await taker.record("chatcmpl-1", tenant.id, "demo", 7, 38)  # the tokens its log held: not added
    twice = [taker.record("chatcmpl-2", tenant.id, "demo", 1, 1) for _ in range(2)]  # within one flush
    await asyncio.gather(*twice, lost.record("chatcmpl-3", tenant.id, "demo", 2, 0))
    rows = await taker.query(tenant.id, None, None)
    assert [(r.prompt_tokens, r.completion_tokens, r.requests) for r in rows] == [(10, 41, 3)]


async def test_usage_survives_a_database_that_refuses_writes(tmp_path) -> None:
    """A real fault: the usage table is gone. The write fails, is counted, and keeps the
    increments; once the table is back the next flush writes them all."""
    from sluice import telemetry

    url = f"sqlite+aiosqlite:///{tmp_path / 'broken.db'}"
    await migrate(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    usage = UsageService(sessions, flush_interval_s=60.0)
    failures = telemetry.REGISTRY.get_sample_value("sluice:usage_write_failures_total") or 0.0
    try:
        tenant = await AdminService(sessions, AuthService(sessions)).create_tenant(TenantCreate(name="t"))
        async with engine.begin() as conn:
            await conn.run_sync(UsageDaily.__table__.drop)
        written = usage.record("r1", tenant.id, "demo", 5, 6)
        with pytest.raises(Exception, match="usage_daily"):
            await usage.flush()
        assert telemetry.REGISTRY.get_sample_value("sluice:usage_write_failures_total") == failures + 1
        assert telemetry.REGISTRY.get_sample_value("sluice:usage_pending_rows") == 1
        assert not written.done()
        usage.record("r2", tenant.id, "demo", 1, 0)
        async with engine.begin() as conn:
            await conn.run_sync(UsageDaily.__table__.create)
        rows = await usage.query(tenant.id, None, None)
        assert [(r.prompt_tokens, r.completion_tokens, r.requests) for r in rows] == [(6, 6, 2)]
        assert telemetry.REGISTRY.get_sample_value("sluice:usage_pending_rows") == 0 and written.done()
    finally:
        await usage.close()
        await engine.dispose()


async def test_a_change_arriving_during_a_key_lookup_is_not_undone_by_it(services) -> None:
    """The lookup read the row before the change: it answers from what it read, but does not cache
    it, so the next lookup sees the change (otherwise a revocation could be undone for a TTL)."""
    from contextlib import asynccontextmanager

    from sluice.gateway.cluster.invalidation import Change, LocalBus

    sessions, _, admin, _ = services
    tenant = await admin.create_tenant(TenantCreate(name="racy"))
    created = await admin.create_key(tenant.id, KeyCreate(name="k"))
    bus = LocalBus()
    raced: list[bool] = []

    class ChangeDuringQuery:
        def __init__(self, session) -> None:
            self._session = session

        async def execute(self, *args, **kwargs):
            result = await self._session.execute(*args, **kwargs)
            if not raced:  # the first lookup only
                raced.append(True)
                await admin.revoke_key(tenant.id, created.id)  # committed while this lookup is in flight
                bus.deliver(Change("key", created.id))
            return result

    @asynccontextmanager
    async def racing_sessions():
        async with sessions() as session:
            yield ChangeDuringQuery(session)

    auth = AuthService(racing_sessions, cache_ttl_s=300.0, bus=bus)  # type: ignore[arg-type]
    assert (await auth.authenticate(created.key)).id == tenant.id  # read before the revocation
    with pytest.raises(OpenAIError) as caught:
        await auth.authenticate(created.key)
    assert caught.value.status == 401


async def test_tenant_objectives_survive_a_restart(services, database_url: str) -> None:
    """Targets set through the admin service are rows: a fresh AuthService (a restarted gateway) reads them."""
    from sluice.objectives import Objective

    _, auth, admin, _ = services
    tenant = await admin.create_tenant(TenantCreate(name="slo", ttft_target_s=2.0))
    key = await admin.create_key(tenant.id, KeyCreate(name="k"))
    assert (await auth.authenticate(key.key)).objective == Objective(ttft_s=2.0)
    await admin.update_tenant(tenant.id, TenantPatch(itl_target_s=0.2))
    assert (await auth.authenticate(key.key)).objective == Objective(ttft_s=2.0, itl_s=0.2)  # evicted at once
    engine = make_engine(database_url)
    try:
        restarted = AuthService(make_session_factory(engine), cache_ttl_s=300.0)
        assert (await restarted.authenticate(key.key)).objective == Objective(ttft_s=2.0, itl_s=0.2)
        await restarted.drain()
    finally:
        await engine.dispose()
    await admin.update_tenant(tenant.id, TenantPatch(ttft_target_s=None))
    assert (await auth.authenticate(key.key)).objective == Objective(itl_s=0.2)
