"""Idempotent seeding of tenants from `settings.tenants` (by name), plus an optional demo key."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy import select

from sluice.gateway.admin.schemas import KeyCreate, Quotas, TenantCreate
from sluice.gateway.admin.service import AdminService
from sluice.gateway.db.models import QUOTA_FIELDS, ApiKey
from sluice.settings import TenantSeed

log = logging.getLogger(__name__)
SEED_ACTOR = "seed"


async def seed_tenants(
    admin: AdminService, seeds: Sequence[TenantSeed], *, demo_key_for: str | None = None
) -> str | None:
    """Creates every seed tenant that does not exist yet (existing ones are left as they are).

    With `demo_key_for` naming a seed tenant that has no usable key, creates one key for it and
    returns it (to be printed once); otherwise returns None. Never creates other keys.
    """
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
    if demo_key_for is None:
        return None
    tenant_id = await admin.find_tenant_id(demo_key_for)
    if tenant_id is None:
        raise ValueError(f"cannot create a demo key: no tenant named {demo_key_for!r}")
    async with admin._sessions() as session:
        active = await session.scalar(
            select(ApiKey.id).where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None)).limit(1)
        )
    if active is not None:
        return None
    demo = await admin.create_key(tenant_id, KeyCreate(name="demo"), actor=SEED_ACTOR)
    return demo.key
