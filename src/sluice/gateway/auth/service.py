"""API keys and the admin token: generation, hashed storage, cached constant-time lookup.

Keys are `sk-slc-` + 32 random bytes (base64url). Only the SHA-256 of a key is stored: with 256
bits of entropy a fast hash is safe. A lookup hashes the presented key, finds the row by hash
(an index lookup reveals nothing useful about the secret) and still compares with
`hmac.compare_digest`. Results are cached for `key_cache_ttl_s`; revoke, rotate and tenant
changes are announced on the invalidation bus (gateway/cluster/invalidation.py), which evicts them at once
here and, when the state is shared, on every other replica too. Unknown keys are remembered too, briefly
(`UNKNOWN_KEY_TTL_S`, at most `UNKNOWN_KEY_CACHE_SIZE` of them, evicted when a key with that hash
is created), so a client retrying a bad key does not cost a database query each time.

The admin token rule: a configured token (`admin.token` / SLUICE_ADMIN_TOKEN) is never stored;
while it is set it is the only admin token, and it removes every stored (generated) one. Without
it, the generated tokens in the database are valid; the first start with none generates one. So a
configured token stops working as soon as it is unset or changed. Secrets are never logged.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from litestar.connection import ASGIConnection
from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.gateway.auth.attempts import FailedSignIns, SignInLimiter
from sluice.gateway.cluster.invalidation import Change, InvalidationBus, LocalBus
from sluice.gateway.db.models import AdminToken, ApiKey, Quota, Tenant
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.quotas.service import QuotaLimits
from sluice.objectives import Objective
from sluice.protocol import Priority

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-slc-"
ADMIN_PREFIX = "slc-admin-"
VISIBLE_CHARS = 6  # of the random part, shown in listings as `sk-slc-ab12cd`
LAST_USED_WRITE_INTERVAL_S = 60.0
UNKNOWN_KEY_TTL_S = 5.0
UNKNOWN_KEY_CACHE_SIZE = 10_000


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def generate_key() -> tuple[str, str, str]:
    """Returns (key, visible prefix, sha256 hex). The key itself is shown once and never stored."""
    body = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode("ascii")
    key = KEY_PREFIX + body
    return key, KEY_PREFIX + body[:VISIBLE_CHARS], hash_secret(key)


def generate_admin_token() -> str:
    return ADMIN_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode("ascii")


def bearer_token(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    header = connection.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@dataclass(frozen=True, slots=True)
class TenantContext:
    """What a request knows about its tenant; immutable, cached with the key."""

    id: str
    name: str
    priority_ceiling: Priority
    default_class: Priority
    weight: float
    allowed_models: frozenset[str]  # empty = every model
    enabled: bool
    limits: QuotaLimits
    key_id: str = ""
    disconnect_grace_s: float | None = None  # None: the gateway's setting
    objective: Objective = field(default_factory=Objective)  # the tenant's own targets; None fields: the class's
    shed_predicted_miss: bool = False  # refuse (429) a request no worker is predicted to serve in time


    def allows_model(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models


def tenant_context(tenant: Tenant, quota: Quota | None, key_id: str = "") -> TenantContext:
    return TenantContext(
        id=tenant.id,
        name=tenant.name,
        priority_ceiling=Priority.parse(tenant.priority_ceiling),
        default_class=Priority.parse(tenant.default_class),
        weight=tenant.weight,
        allowed_models=frozenset(tenant.allowed_models or ()),
        enabled=tenant.enabled,
        limits=QuotaLimits.from_row(quota),
        key_id=key_id,
        disconnect_grace_s=tenant.disconnect_grace_s,
        objective=Objective(ttft_s=tenant.ttft_target_s, itl_s=tenant.itl_target_s),
        shed_predicted_miss=tenant.on_predicted_miss == "shed",
    )


@dataclass(slots=True)
class _CacheEntry:
    context: TenantContext
    expires_at: dt.datetime | None  # the key's own expiry
    cached_until: float  # monotonic


class AuthService:
    """Authenticates tenant keys (cached) and the admin token."""

    def __init__(
        self,
        session_factory: async_sessionmaker[AsyncSession],
        *,
        cache_ttl_s: float = 30.0,
        bus: InvalidationBus | None = None,
        sign_ins: SignInLimiter | None = None,
    ) -> None:
        self._sessions = session_factory
        self._ttl = cache_ttl_s
        self._cache: dict[str, _CacheEntry] = {}  # key hash -> entry
        self._unknown: OrderedDict[str, float] = OrderedDict()  # key hash -> monotonic expiry, oldest first
        self._last_used_written: dict[str, float] = {}  # key id -> monotonic time of last write
        self._admin_hashes: frozenset[str] = frozenset()
        # Wrong admin tokens per source address (auth/attempts.py), in this process unless shared.
        self.sign_ins: SignInLimiter = sign_ins if sign_ins is not None else FailedSignIns()
        self._tasks: set[asyncio.Task[None]] = set()
        # Counts the changes applied: a lookup that read the database before a change arrived
        # does not cache what it read (it may be what the change invalidated).
        self._changes = 0
        self._bus: InvalidationBus = bus if bus is not None else LocalBus()
        self._bus.subscribe(self._apply)

    # ---- tenant keys ---------------------------------------------------------------------------

    async def authenticate(self, key: str | None) -> TenantContext:
        if not key:
            raise OpenAIError(
                401,
                "Missing API key: send `Authorization: Bearer <key>`.",
                type="invalid_request_error",
                code="missing_api_key",
            )
        digest = hash_secret(key)
        now_mono = time.monotonic()
        now = dt.datetime.now(dt.UTC)
        entry = self._cache.get(digest)
        if entry is None or entry.cached_until < now_mono:
            unknown_until = self._unknown.get(digest)
            if unknown_until is not None and unknown_until > now_mono:
                raise _invalid_key()
            entry = await self._load(digest, now_mono)
        if entry is None:
            raise _invalid_key()
        if entry.expires_at is not None and entry.expires_at <= now:
            self._cache.pop(digest, None)
            raise OpenAIError(
                401, "This API key has expired.", type="invalid_request_error", code="invalid_api_key"
            )
        if not entry.context.enabled:
            raise OpenAIError(
                403, "This tenant is disabled.", type="permission_error", code="tenant_disabled"
            )
        self._touch(entry.context.key_id, now_mono)
        return entry.context

    async def _load(self, digest: str, now_mono: float) -> _CacheEntry | None:
        changes_before = self._changes
        async with self._sessions() as session:
            row = (
                await session.execute(
                    select(ApiKey, Tenant, Quota)
                    .join(Tenant, Tenant.id == ApiKey.tenant_id)
                    .outerjoin(Quota, Quota.tenant_id == Tenant.id)
                    .where(ApiKey.hash == digest)
                )
            ).first()
        current = self._changes == changes_before
        if row is None or not hmac.compare_digest(row[0].hash, digest) or row[0].revoked_at is not None:
            self._cache.pop(digest, None)
            if current:
                self._remember_unknown(digest, now_mono)
            return None
        key, tenant, quota = row
        entry = _CacheEntry(tenant_context(tenant, quota, key.id), key.expires_at, now_mono + self._ttl)
        if current:
            self._cache[digest] = entry
        return entry

    def _remember_unknown(self, digest: str, now_mono: float) -> None:
        self._unknown.pop(digest, None)
        self._unknown[digest] = now_mono + UNKNOWN_KEY_TTL_S
        while len(self._unknown) > UNKNOWN_KEY_CACHE_SIZE:
            self._unknown.popitem(last=False)

    async def tenant_by_id(self, tenant_id: str) -> TenantContext | None:
        """A tenant's context read from the database (no key: for a stream taken over from a lost
        replica, gateway/streams/resumer.py); None when it no longer exists."""
        async with self._sessions() as session:
            row = (
                await session.execute(
                    select(Tenant, Quota).outerjoin(Quota, Quota.tenant_id == Tenant.id).where(Tenant.id == tenant_id)
                )
            ).first()
        return None if row is None else tenant_context(row[0], row[1])

    def key_created(self, digest: str) -> None:
        """A key with this hash now exists: it is no longer an unknown key here."""
        self._unknown.pop(digest, None)

    def _touch(self, key_id: str, now_mono: float) -> None:
        """Writes last_used_at at most once a minute per key, off the request path."""
        last = self._last_used_written.get(key_id)
        if last is not None and now_mono - last < LAST_USED_WRITE_INTERVAL_S:
            return
        self._last_used_written[key_id] = now_mono
        task = asyncio.get_running_loop().create_task(self._write_last_used(key_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write_last_used(self, key_id: str) -> None:
        try:
            async with self._sessions() as session, session.begin():
                await session.execute(
                    update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=dt.datetime.now(dt.UTC))
                )
        except Exception:  # best effort: a busy database must not fail requests
            log.warning("could not record last use of key %s", key_id, exc_info=True)

    async def announce(self, change: Change) -> None:
        """A committed admin change: evicts it here and on every replica sharing the bus."""
        await self._bus.publish(change)

    def _apply(self, change: Change) -> None:
        self._changes += 1
        if change.kind == "key":
            self.invalidate_key(change.ident)
        elif change.kind == "tenant":
            self.invalidate_tenant(change.ident)
        elif change.kind == "key_created":
            self.key_created(change.ident)
        elif change.kind == "everything":
            self._cache.clear()
            self._unknown.clear()

    def invalidate_key(self, key_id: str) -> None:
        for digest in [d for d, e in self._cache.items() if e.context.key_id == key_id]:
            del self._cache[digest]

    def invalidate_tenant(self, tenant_id: str) -> None:
        for digest in [d for d, e in self._cache.items() if e.context.id == tenant_id]:
            del self._cache[digest]

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- admin token ---------------------------------------------------------------------------

    async def ensure_admin_token(self, configured: str = "") -> str | None:
        """Applies the admin token rule (module docstring).

        Returns a newly generated token (to show once) or None when nothing was generated.
        """
        async with self._sessions() as session, session.begin():
            if configured:
                await session.execute(delete(AdminToken))
                self._admin_hashes = frozenset({hash_secret(configured)})
                return None
            hashes = set((await session.execute(select(AdminToken.hash))).scalars())
            generated: str | None = None
            if not hashes:
                generated = generate_admin_token()
                hashes.add(hash_secret(generated))
                session.add(AdminToken(hash=hash_secret(generated)))
            self._admin_hashes = frozenset(hashes)
        return generated

    def admin_binding(self) -> str:
        """A fingerprint of the admin token(s) in force: console sessions are bound to it, so a
        changed admin token ends every session signed in with the old one."""
        return hashlib.sha256("\n".join(sorted(self._admin_hashes)).encode()).hexdigest()

    def verify_admin(self, token: str | None) -> bool:
        if not token:
            return False
        digest = hash_secret(token)
        # compare against every stored hash so timing does not depend on which matched
        return any([hmac.compare_digest(digest, h) for h in self._admin_hashes])


def _invalid_key() -> OpenAIError:
    return OpenAIError(
        401, "Incorrect API key provided.", type="invalid_request_error", code="invalid_api_key"
    )
