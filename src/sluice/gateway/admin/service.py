"""Tenant, key and quota administration. Every mutation writes an audit_log row in its transaction
and evicts this process's auth cache, so a change applies to the very next request.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from msgspec import UNSET as _UNSET
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.gateway.admin.schemas import (
    AuditOut,
    KeyCreate,
    KeyCreated,
    KeyOut,
    Quotas,
    QuotasPatch,
    TenantCreate,
    TenantDeleted,
    TenantOut,
    TenantPatch,
)
from sluice.gateway.auth.service import AuthService, generate_key, hash_secret
from sluice.gateway.cluster.invalidation import Change
from sluice.gateway.db.base import Base, new_id, utcnow
from sluice.gateway.db.models import QUOTA_FIELDS, ApiKey, AuditLog, Quota, Tenant
from sluice.gateway.edge.errors import OpenAIError
from sluice.protocol import Priority

log = logging.getLogger(__name__)

ADMIN_ACTOR = "admin"


def _not_found(what: str, ident: str) -> OpenAIError:
    return OpenAIError(404, f"No {what} with id {ident!r}.", code=f"{what}_not_found")


def _check_classes(ceiling: str, default: str) -> None:
    if Priority.parse(default) < Priority.parse(ceiling):
        raise OpenAIError(
            400, f"default_class {default!r} is above priority_ceiling {ceiling!r}.", param="default_class"
        )


def tenant_out(tenant: Tenant, quota: Quota | None) -> TenantOut:
    return TenantOut(
        id=tenant.id,
        name=tenant.name,
        description=tenant.description,
        priority_ceiling=tenant.priority_ceiling,  # type: ignore[arg-type]
        default_class=tenant.default_class,  # type: ignore[arg-type]
        weight=tenant.weight,
        allowed_models=list(tenant.allowed_models or []),
        enabled=tenant.enabled,
        created_at=tenant.created_at,
        disconnect_grace_s=tenant.disconnect_grace_s,
        ttft_target_s=tenant.ttft_target_s,
        itl_target_s=tenant.itl_target_s,
        on_predicted_miss=tenant.on_predicted_miss,  # type: ignore[arg-type]
        quotas=Quotas(**(quota.limits() if quota is not None else {})),
    )


def key_out(key: ApiKey) -> KeyOut:
    return KeyOut(
        id=key.id,
        tenant_id=key.tenant_id,
        prefix=key.prefix,
        name=key.name,
        created_at=key.created_at,
        expires_at=key.expires_at,
        revoked_at=key.revoked_at,
        last_used_at=key.last_used_at,
    )


async def tenant_with_quota(session: AsyncSession, tenant_id: str) -> tuple[Tenant, Quota | None] | None:
    """The tenant and its quota row (None when it has none), or None when there is no such tenant."""
    row = (
        await session.execute(
            select(Tenant, Quota).outerjoin(Quota, Quota.tenant_id == Tenant.id).where(Tenant.id == tenant_id)
        )
    ).first()
    return None if row is None else (row[0], row[1])


class AdminService:
    def __init__(self, session_factory: async_sessionmaker[AsyncSession], auth: AuthService,
                 flush_usage: Callable[[], Awaitable[None]] | None = None) -> None:
        self._sessions = session_factory
        self._auth = auth
        self._flush_usage = flush_usage  # usage is written behind; history checks must see all of it
        # Called with a tenant's id once it is disabled (or deleted): e.g. the Batch API stops its work.
        self.on_tenant_disabled: list[Callable[[str], Awaitable[None]]] = []

    async def _tenant_disabled(self, tenant_id: str) -> None:
        await self._auth.announce(Change("tenant_disabled", tenant_id))  # its streams, on every replica
        for listener in self.on_tenant_disabled:
            try:
                await listener(tenant_id)
            except Exception:
                log.exception("stopping the work of disabled tenant %s failed", tenant_id)

    # ---- tenants -------------------------------------------------------------------------------

    async def create_tenant(self, body: TenantCreate, actor: str = ADMIN_ACTOR) -> TenantOut:
        _check_classes(body.priority_ceiling, body.default_class)
        tenant = Tenant(
            id=new_id("ten"),
            name=body.name,
            description=body.description,
            priority_ceiling=body.priority_ceiling,
            default_class=body.default_class,
            weight=body.weight,
            allowed_models=list(body.allowed_models),
            enabled=True,
            created_at=utcnow(),
            disconnect_grace_s=body.disconnect_grace_s,
            ttft_target_s=body.ttft_target_s,
            itl_target_s=body.itl_target_s,
            on_predicted_miss=body.on_predicted_miss,
        )
        quota = Quota(tenant_id=tenant.id, **{f: getattr(body.quotas, f) for f in QUOTA_FIELDS})
        try:
            async with self._sessions() as session, session.begin():
                session.add(tenant)
                await session.flush()
                session.add(quota)
                self._audit(
                    session,
                    actor,
                    "tenant.create",
                    tenant.id,
                    {
                        "name": body.name,
                        "priority_ceiling": body.priority_ceiling,
                        "default_class": body.default_class,
                        "weight": body.weight,
                        "allowed_models": list(body.allowed_models),
                        "disconnect_grace_s": body.disconnect_grace_s,
                        "ttft_target_s": body.ttft_target_s,
                        "itl_target_s": body.itl_target_s,
                        "on_predicted_miss": body.on_predicted_miss,
                        "quotas": quota.limits(),
                    },
                )
        except IntegrityError:
            raise OpenAIError(
                409, f"A tenant named {body.name!r} already exists.", param="name", code="tenant_exists"
            ) from None
        return tenant_out(tenant, quota)

    async def list_tenants(self) -> list[TenantOut]:
        async with self._sessions() as session:
            rows = (
                await session.execute(
                    select(Tenant, Quota)
                    .outerjoin(Quota, Quota.tenant_id == Tenant.id)
                    .order_by(Tenant.created_at)
                )
            ).all()
        return [tenant_out(t, q) for t, q in rows]

    async def get_tenant(self, tenant_id: str) -> TenantOut:
        async with self._sessions() as session:
            tenant, quota = await self._load(session, tenant_id)
        return tenant_out(tenant, quota)

    async def tenant_names(self) -> dict[str, str]:
        """Every tenant's name by id (one narrow query: the console labels live views with it)."""
        async with self._sessions() as session:
            return {tid: name for tid, name in (await session.execute(select(Tenant.id, Tenant.name))).all()}

    async def find_tenant_id(self, name: str) -> str | None:
        async with self._sessions() as session:
            return await session.scalar(select(Tenant.id).where(Tenant.name == name))

    async def update_tenant(self, tenant_id: str, body: TenantPatch, actor: str = ADMIN_ACTOR) -> TenantOut:
        changes = {
            f: getattr(body, f)
            for f in body.__struct_fields__
            if f != "quotas" and getattr(body, f) is not _UNSET
        }
        try:
            async with self._sessions() as session, session.begin():
                tenant, quota = await self._load(session, tenant_id)
                for name, value in changes.items():
                    setattr(tenant, name, list(value) if name == "allowed_models" else value)
                _check_classes(tenant.priority_ceiling, tenant.default_class)
                quota_changes = body.quotas.changes() if isinstance(body.quotas, QuotasPatch) else {}
                if quota_changes:
                    quota = self._apply_quota(session, tenant_id, quota, quota_changes)
                self._audit(
                    session,
                    actor,
                    "tenant.update",
                    tenant_id,
                    {**changes, **({"quotas": quota_changes} if quota_changes else {})},
                )
        except IntegrityError:
            raise OpenAIError(
                409, "A tenant with that name already exists.", param="name", code="tenant_exists"
            ) from None
        await self._auth.announce(Change("tenant", tenant_id))
        if changes.get("enabled") is False:
            await self._tenant_disabled(tenant_id)
        return tenant_out(tenant, quota)

    async def delete_tenant(self, tenant_id: str, actor: str = ADMIN_ACTOR) -> TenantDeleted:
        if self._flush_usage is not None:
            await self._flush_usage()
        async with self._sessions() as session, session.begin():
            tenant, _ = await self._load(session, tenant_id)
            if await self._has_history(session, tenant_id):
                tenant.enabled = False
                self._audit(session, actor, "tenant.disable", tenant_id, {"reason": "has history"})
                result = TenantDeleted(
                    id=tenant_id,
                    deleted=False,
                    disabled=True,
                    message="The tenant has usage or batch history, so it was disabled, not deleted; "
                    "its keys no longer work.",
                )
            else:
                await session.execute(delete(ApiKey).where(ApiKey.tenant_id == tenant_id))
                await session.execute(delete(Quota).where(Quota.tenant_id == tenant_id))
                await session.delete(tenant)
                self._audit(session, actor, "tenant.delete", tenant_id, {"name": tenant.name})
                result = TenantDeleted(
                    id=tenant_id,
                    deleted=True,
                    disabled=False,
                    message="The tenant and its keys were deleted.",
                )
        await self._auth.announce(Change("tenant", tenant_id))
        await self._tenant_disabled(tenant_id)
        return result

    @staticmethod
    async def _has_history(session: AsyncSession, tenant_id: str) -> bool:
        """Usage rows, or rows of any other table with a tenant_id (e.g. the Batch API's files)."""
        own = {"tenant", "api_key", "quota"}
        for table in Base.metadata.sorted_tables:
            if table.name in own or "tenant_id" not in table.c:
                continue
            found = await session.scalar(
                select(table.c.tenant_id).where(table.c.tenant_id == tenant_id).limit(1)
            )
            if found is not None:
                return True
        return False

    # ---- keys ----------------------------------------------------------------------------------

    async def create_key(self, tenant_id: str, body: KeyCreate, actor: str = ADMIN_ACTOR) -> KeyCreated:
        now = utcnow()
        expires_at = body.expires_at
        if body.expires_in_days is not None and expires_at is not None:
            raise OpenAIError(400, "Give expires_in_days or expires_at, not both.", param="expires_at")
        if body.expires_in_days is not None:
            expires_at = now + dt.timedelta(days=body.expires_in_days)
        if expires_at is not None:
            if expires_at.tzinfo is None:
                expires_at = expires_at.replace(tzinfo=dt.UTC)
            if expires_at <= now:
                raise OpenAIError(400, "expires_at must be in the future.", param="expires_at")
        async with self._sessions() as session, session.begin():
            await self._load(session, tenant_id)
            created = self._new_key(session, tenant_id, body.name, expires_at, actor, "key.create")
        await self._auth.announce(Change("key_created", hash_secret(created.key)))
        return created

    def _new_key(
        self,
        session: AsyncSession,
        tenant_id: str,
        name: str,
        expires_at: dt.datetime | None,
        actor: str,
        action: str,
        details: dict[str, Any] | None = None,
    ) -> KeyCreated:
        secret, prefix, digest = generate_key()
        key = ApiKey(
            id=new_id("key"),
            tenant_id=tenant_id,
            prefix=prefix,
            hash=digest,
            name=name,
            created_at=utcnow(),
            expires_at=expires_at,
        )
        session.add(key)
        self._audit(
            session,
            actor,
            action,
            tenant_id,
            {
                "key_id": key.id,
                "prefix": prefix,
                "name": name,
                "expires_at": expires_at.isoformat() if expires_at else None,
                **(details or {}),
            },
        )
        return KeyCreated(
            id=key.id,
            tenant_id=tenant_id,
            key=secret,
            prefix=prefix,
            name=name,
            created_at=key.created_at,
            expires_at=expires_at,
        )

    async def list_keys(self, tenant_id: str) -> list[KeyOut]:
        async with self._sessions() as session:
            await self._load(session, tenant_id)
            keys = (
                (
                    await session.execute(
                        select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
                    )
                )
                .scalars()
                .all()
            )
        return [key_out(k) for k in keys]

    async def revoke_key(self, tenant_id: str, key_id: str, actor: str = ADMIN_ACTOR) -> KeyOut:
        async with self._sessions() as session, session.begin():
            key = await self._key(session, tenant_id, key_id)
            revoked_now = key.revoked_at is None
            if revoked_now:
                key.revoked_at = utcnow()
                self._audit(session, actor, "key.revoke", tenant_id, {"key_id": key_id, "prefix": key.prefix})
            last = revoked_now and not await self._has_live_key(session, tenant_id)
        await self._auth.announce(Change("key", key_id))
        if last:  # nothing can authenticate as the tenant any more: its streams stop, on every replica
            await self._auth.announce(Change("keys_revoked", tenant_id))
        return key_out(key)

    @staticmethod
    async def _has_live_key(session: AsyncSession, tenant_id: str) -> bool:
        now = utcnow()
        found = await session.scalar(
            select(ApiKey.id).where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None),
                                    (ApiKey.expires_at.is_(None)) | (ApiKey.expires_at > now)).limit(1))
        return found is not None

    async def rotate_key(self, tenant_id: str, key_id: str, actor: str = ADMIN_ACTOR) -> KeyCreated:
        async with self._sessions() as session, session.begin():
            old = await self._key(session, tenant_id, key_id)
            if old.revoked_at is not None:
                raise OpenAIError(
                    400, "This key is already revoked; create a new key instead.", code="key_revoked"
                )
            old.revoked_at = utcnow()
            created = self._new_key(
                session, tenant_id, old.name, old.expires_at, actor, "key.rotate", {"replaces": key_id}
            )
        await self._auth.announce(Change("key", key_id))
        await self._auth.announce(Change("key_created", hash_secret(created.key)))
        return created

    # ---- quotas --------------------------------------------------------------------------------

    async def get_quotas(self, tenant_id: str) -> Quotas:
        return (await self.get_tenant(tenant_id)).quotas

    async def update_quotas(self, tenant_id: str, body: QuotasPatch, actor: str = ADMIN_ACTOR) -> Quotas:
        changes = body.changes()
        async with self._sessions() as session, session.begin():
            _, quota = await self._load(session, tenant_id)
            quota = self._apply_quota(session, tenant_id, quota, changes)
            self._audit(session, actor, "quota.update", tenant_id, changes)
        await self._auth.announce(Change("tenant", tenant_id))
        return Quotas(**quota.limits())

    @staticmethod
    def _apply_quota(
        session: AsyncSession, tenant_id: str, quota: Quota | None, changes: dict[str, Any]
    ) -> Quota:
        if quota is None:
            quota = Quota(tenant_id=tenant_id)
            session.add(quota)
        for name, value in changes.items():
            setattr(quota, name, value)
        return quota

    # ---- audit ---------------------------------------------------------------------------------

    async def audit(self, limit: int = 100, target: str | None = None) -> list[AuditOut]:
        statement = select(AuditLog).order_by(AuditLog.id.desc()).limit(limit)
        if target is not None:
            statement = statement.where(AuditLog.target == target)
        async with self._sessions() as session:
            rows: Sequence[AuditLog] = (await session.execute(statement)).scalars().all()
        return [
            AuditOut(
                id=r.id,
                at=r.at,
                actor=r.actor,
                action=r.action,
                target=r.target,
                details=dict(r.details or {}),
            )
            for r in rows
        ]

    async def record(self, action: str, target: str, details: dict[str, Any], actor: str = ADMIN_ACTOR) -> None:
        """Audit an action that changes no tenant row (a drained worker, a cancelled batch, a sign-in)."""
        async with self._sessions() as session, session.begin():
            self._audit(session, actor, action, target, details)

    @staticmethod
    def _audit(session: AsyncSession, actor: str, action: str, target: str, details: dict[str, Any]) -> None:
        session.add(AuditLog(at=utcnow(), actor=actor, action=action, target=target, details=details))

    # ---- helpers -------------------------------------------------------------------------------

    @staticmethod
    async def _load(session: AsyncSession, tenant_id: str) -> tuple[Tenant, Quota | None]:
        found = await tenant_with_quota(session, tenant_id)
        if found is None:
            raise _not_found("tenant", tenant_id)
        return found

    @staticmethod
    async def _key(session: AsyncSession, tenant_id: str, key_id: str) -> ApiKey:
        key = await session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id))
        if key is None:
            raise _not_found("key", key_id)
        return key
