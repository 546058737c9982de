"""Changes every gateway replica must act on at once: a key revoked, a tenant or its quotas
changed (caches), a batch stopped (its lines held by whichever replica runs them), a tenant's
streams stopped (pumped by whichever replica took them).

The admin service announces each cache change once (`AuthService.announce`) after its transaction
commits, and the Batch API announces a cancelled or tenant-stopped batch once its status is
committed; the bus delivers each to every replica's handlers:

- `LocalBus`: to the handlers in this process, at once (the single-process default).
- `RedisBus`: here at once, and to the other replicas through Redis pub/sub (a message takes
  about a millisecond). A replica whose subscription breaks drops its whole cache, when the break
  is noticed and again once resubscribed, since it may have missed changes meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal, Protocol

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.gateway.cluster.pubsub import Subscription

log = logging.getLogger(__name__)

SUBSCRIBE_WAIT_S = 5.0  # start() waits this long for the subscription, then lets it go on trying


class Change(msgspec.Struct, frozen=True):
    """`key`: a key id revoked or rotated; `tenant`: a tenant id changed or deleted; `key_created`:
    the hash of a new key (no longer an unknown key); `everything`: drop the whole cache;
    `batch_stopped`: a batch id now cancelling (its lines queued or running anywhere end now);
    `tenant_disabled` / `keys_revoked`: a tenant id disabled or deleted / whose last key was
    revoked (its streams running anywhere end now). Handlers ignore the kinds they do not act on."""

    kind: Literal["key", "tenant", "key_created", "everything", "batch_stopped", "tenant_disabled", "keys_revoked"]
    ident: str = ""


Handler = Callable[[Change], None]


class InvalidationBus(Protocol):
    def subscribe(self, handler: Handler) -> None: ...

    async def publish(self, change: Change) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class LocalBus:
    def __init__(self) -> None:
        self._handlers: list[Handler] = []

    def subscribe(self, handler: Handler) -> None:
        self._handlers.append(handler)

    def deliver(self, change: Change) -> None:
        for handler in self._handlers:
            handler(change)

    async def publish(self, change: Change) -> None:
        self.deliver(change)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


class RedisBus(LocalBus):
    """`client` should not retry behind our back: a silent reconnect could hide missed messages."""

    def __init__(self, client: Redis, channel: str) -> None:
        super().__init__()
        self._client = client
        self.channel = channel
        # A lost subscription may have missed changes: the whole cache goes, when the loss is
        # noticed and again once resubscribed (changes made between the two).
        self._subscription = Subscription(client, channel, self._received, what="invalidations",
                                          on_lost=self._drop_everything, on_back=self._drop_everything)

    async def publish(self, change: Change) -> None:
        self.deliver(change)
        try:
            await self._client.publish(self.channel, msgspec.json.encode(change))
        except RedisError as exc:
            # Committed already; the other replicas see it at their cache TTL, or sooner when
            # their own subscription broke too (they then drop everything).
            log.error("shared state: could not announce %s %s to the other replicas: %s",
                      change.kind, change.ident, exc)

    async def start(self) -> None:
        self._subscription.start()
        if not await self._subscription.wait_subscribed(SUBSCRIBE_WAIT_S):
            log.error("shared state: no subscription to %s yet; retrying in the background", self.channel)

    async def stop(self) -> None:
        await self._subscription.stop()

    def _drop_everything(self) -> None:
        self.deliver(Change("everything"))

    def _received(self, data: bytes) -> None:
        try:
            change = msgspec.json.decode(data, type=Change)
        except msgspec.DecodeError:
            log.warning("shared state: ignoring a malformed invalidation on %s", self.channel)
            return
        self.deliver(change)
