"""The state gateway replicas share, built once from `[shared]`: a quota ledger, an invalidation
bus and the global schedule's worker slots and fairness counters, in this process (`url` empty) or in Redis
(docs/scale-out.md)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from sluice.gateway.cluster.invalidation import InvalidationBus, LocalBus, RedisBus
from sluice.gateway.dispatch.fair_shared import RedisFairness
from sluice.gateway.dispatch.slots import LocalSlots, RedisSlots, WorkerSlots
from sluice.gateway.quotas.ledger import LocalLedger, QuotaLedger
from sluice.gateway.quotas.redis_ledger import RedisLedger
from sluice.gateway.streams.local_log import LocalStreamLog
from sluice.gateway.streams.log import DEFAULT_RETENTION_S, StreamLog
from sluice.gateway.streams.redis_log import RedisStreamLog
from sluice.settings import SharedSettings

# A Redis that does not answer within this long fails the admission (503), not the event loop.
REDIS_TIMEOUT_S = 2.0


@dataclass(slots=True)
class SharedState:
    ledger: QuotaLedger
    bus: InvalidationBus
    replica: str  # this process's replica id: what its holds, leases and ownerships are filed under
    clients: tuple[Redis, ...] = field(default=())
    slots: WorkerSlots = field(default_factory=LocalSlots)  # who may send to a worker (gateway/dispatch/slots.py)
    fairness: RedisFairness | None = None  # the fair scheduler's counters, cluster-wide (None: this process's)
    stream_log: StreamLog = field(default_factory=LocalStreamLog)  # streamed responses' events (docs/streams.md)

    async def start(self) -> None:
        await self.ledger.start()
        await self.bus.start()
        await self.stream_log.start()

    async def ready(self) -> dict[str, bool]:
        """`/ready`'s check: {"shared": Redis answers}, or nothing when the state is in-process."""
        if not self.clients:
            return {}
        try:
            await self.clients[0].ping()
        except (RedisError, OSError):
            return {"shared": False}
        return {"shared": True}

    async def stop(self) -> None:
        """After the gateway's own requests have ended: settles what is left and gives the lease up."""
        await self.stream_log.stop()
        await self.bus.stop()
        await self.ledger.stop()
        for client in self.clients:
            await client.aclose()


def _client(url: str, *, retries: int) -> Redis:
    return Redis.from_url(
        url,
        socket_timeout=REDIS_TIMEOUT_S,
        socket_connect_timeout=REDIS_TIMEOUT_S,
        retry=Retry(NoBackoff(), retries),
        health_check_interval=5,
    )


def new_replica_id() -> str:
    """Unique per process start: a restarted replica is a new one (its predecessor's holds expire)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def open_shared(
    settings: SharedSettings, *, replica: str | None = None, stream_retention_s: float = DEFAULT_RETENTION_S
) -> SharedState:
    """One per gateway process: the app and the backend share it (pass it to both).
    `stream_retention_s` is `gateway.stream_retention_s`."""
    replica = replica or new_replica_id()
    if not settings.url:
        return SharedState(
            LocalLedger(), LocalBus(), replica, stream_log=LocalStreamLog(retention_s=stream_retention_s)
        )
    commands = _client(settings.url, retries=1)
    # The subscription gets no silent retries: the bus must see every break (it may have missed messages).
    subscription = _client(settings.url, retries=0)
    return SharedState(
        RedisLedger(commands, prefix=settings.prefix, lease_s=settings.lease_s, replica=replica),
        RedisBus(subscription, f"{settings.prefix}:invalidate"),
        replica,
        (commands, subscription),
        RedisSlots(commands, prefix=settings.prefix, lease_s=settings.lease_s, replica=replica,
                   subscription=subscription),
        RedisFairness(commands, prefix=settings.prefix, lease_s=settings.lease_s, replica=replica),
        RedisStreamLog(commands, prefix=settings.prefix, retention_s=stream_retention_s, replica=replica),
    )
