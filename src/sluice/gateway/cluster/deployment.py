"""Which deployment a gateway belongs to, and its claim on the Redis prefix.

Two deployments (each with its own database) on one Redis with one `shared.prefix` would share
every counter filed under it: worker-room counts (workers are named `local-0` by default),
fairness counters, replica leases. So a deployment claims its prefix: its id (one random row in its
database, the same for all its replicas) is written at `P:deployment` with a short expiry that its
replicas renew. A gateway whose database holds another id refuses to start with a one-line error
naming the setting to change; a deployment that is gone gives its prefix up after `claim_ttl_s`.
Pub/sub ignores the database number, so channel names carry it (`channel_prefix`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.errors import ConfigError
from sluice.gateway.cluster.pubsub import cancel_and_wait
from sluice.gateway.db.models import Deployment

log = logging.getLogger(__name__)

# Sets the claim when nobody holds it, renews it when we do; 0 when another deployment holds it.
# KEYS: the claim; ARGV: our id, expiry in ms.
CLAIM = r"""
local holder = redis.call('GET', KEYS[1])
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
if holder == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""


async def deployment_id(sessions: async_sessionmaker[AsyncSession]) -> str:
    """This database's deployment id, made by the first start (replicas starting together agree:
    the row has one fixed key, so only one insert wins)."""
    async with sessions() as session:
        found = await session.scalar(select(Deployment.id).where(Deployment.row == 1))
    if found is not None:
        return found
    try:
        async with sessions() as session, session.begin():
            session.add(Deployment(row=1, id=uuid.uuid4().hex))
    except IntegrityError:  # another replica's first start won
        pass
    async with sessions() as session:
        return str(await session.scalar(select(Deployment.id).where(Deployment.row == 1)))


def channel_prefix(client: Redis, prefix: str) -> str:
    """What pub/sub channel names start with: the prefix and the database number (pub/sub is one
    namespace for the whole server, so deployments on databases /0 and /1 would hear each other)."""
    return f"{prefix}:db{int(client.connection_pool.connection_kwargs.get('db', 0) or 0)}"


def foreign_deployment(prefix: str, ttl_s: float) -> ConfigError:
    return ConfigError(
        f"another sluice deployment (another database) uses the Redis prefix {prefix!r} on this Redis: "
        f"set SLUICE_SHARED_PREFIX (or [shared] prefix) to a prefix of its own on every replica; "
        f"if that deployment is gone, its claim expires within {ttl_s:g} s")


class PrefixClaim:
    """Holds `P:deployment` for this deployment from `claim()` to `stop()`."""

    def __init__(self, client: Redis, *, prefix: str, lease_s: float) -> None:
        self._client = client
        self.prefix = prefix
        self._key = f"{prefix}:deployment"
        self.ttl_s = max(3 * lease_s, 1.0)
        self._renew_s = lease_s / 3
        self._script = client.register_script(CLAIM)
        self._deployment = ""
        self._task: asyncio.Task[None] | None = None

    async def _hold(self) -> bool:
        return bool(await self._script(keys=[self._key], args=[self._deployment, int(self.ttl_s * 1000)]))

    async def claim(self, deployment: str) -> None:
        """Raises ConfigError when another deployment holds the prefix. A Redis that does not answer
        now is checked again at each renewal (admission answers 503 meanwhile anyway)."""
        self._deployment = deployment
        try:
            if not await self._hold():
                raise foreign_deployment(self.prefix, self.ttl_s)
        except RedisError as exc:
            log.error("shared state: could not check the Redis prefix's deployment at start (%s)", exc)
        self._task = asyncio.get_running_loop().create_task(self._renew_forever(), name="prefix-claim")

    async def _renew_forever(self) -> None:
        """Another deployment may take the prefix while ours lapsed (Redis flushed or away longer
        than the expiry): logged once each time that starts, not at every renewal."""
        foreign = False
        while True:
            await asyncio.sleep(self._renew_s)
            try:
                held = await self._hold()
            except RedisError as exc:
                log.warning("shared state: renewing the prefix's deployment claim failed: %s", exc)
                continue
            if not held and not foreign:
                log.error("shared state: %s", foreign_deployment(self.prefix, self.ttl_s))
            foreign = not held

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
