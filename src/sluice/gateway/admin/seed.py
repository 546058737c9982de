"""Idempotent seeding of tenants from `settings.tenants` (by name), and the one demo key of `sluice serve`.

The demo key rule: the demo tenant has at most one live key named `DEMO_KEY_NAME`, with an expiry.
A start that finds one creates nothing (and shows only its prefix: keys are stored hashed); a
start that finds none (first start, or the old one expired) creates one and revokes every older
demo key; `sluice serve --new-demo-key` revokes the live one and creates a new one.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select

from sluice.gateway.admin.schemas import KeyCreate, Quotas, TenantCreate
from sluice.gateway.admin.service import AdminService
from sluice.gateway.db.models import QUOTA_FIELDS, ApiKey
from sluice.settings import TenantSeed

log = logging.getLogger(__name__)
SEED_ACTOR = "seed"
DEMO_KEY_NAME = "sluice serve demo"


@dataclass(frozen=True, slots=True)
class DemoKey:
    tenant_id: str
    prefix: str  # visible part of the live demo key
    expires_at: dt.datetime | None
    key: str | None = None  # the key itself, only when this call created it (show it once)


async def seed_tenants(admin: AdminService, seeds: Sequence[TenantSeed]) -> None:
    """Creates every seed tenant that does not exist yet (existing ones are left as they are).
    Never creates keys."""
    created = 0
    for seed in seeds:
        if await admin.find_tenant_id(seed.name) is not None:
            continue
        body = TenantCreate(
            name=seed.name,
            description=seed.description,
            priority_ceiling=seed.priority_ceiling,
            default_class=seed.default_class,
            weight=seed.weight,
            allowed_models=list(seed.allowed_models),
            quotas=Quotas(**{f: getattr(seed.quotas, f) for f in QUOTA_FIELDS}),
        )
        tenant = await admin.create_tenant(body, actor=SEED_ACTOR)
        log.debug("seeded tenant %s (%s)", seed.name, tenant.id)
        created += 1
    if created:
        log.info("seeded %d tenant(s); %d already existed", created, len(seeds) - created)


async def ensure_demo_key(admin: AdminService, tenant_name: str, *, ttl_days: int,
                          renew: bool = False) -> DemoKey | None:
    """Applies the demo key rule (module docstring) to the tenant named `tenant_name`; None when no
    such tenant exists."""
    tenant_id = await admin.find_tenant_id(tenant_name)
    if tenant_id is None:
        return None
    now = dt.datetime.now(dt.UTC)
    async with admin._sessions() as session:
        live = (await session.scalars(
            select(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.name == DEMO_KEY_NAME,
                                 ApiKey.revoked_at.is_(None))
        )).all()
    current = [k for k in live if k.expires_at is None or _aware(k.expires_at) > now]
    if current and not renew:
        newest = max(current, key=lambda k: _aware(k.created_at))
        return DemoKey(tenant_id, newest.prefix, newest.expires_at)
    for old in live:
        await admin.revoke_key(tenant_id, old.id, actor=SEED_ACTOR)
    created = await admin.create_key(
        tenant_id, KeyCreate(name=DEMO_KEY_NAME, expires_in_days=ttl_days), actor=SEED_ACTOR)
    return DemoKey(tenant_id, created.prefix, created.expires_at, key=created.key)


def _aware(value: dt.datetime) -> dt.datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
