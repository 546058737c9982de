"""Changes every gateway replica must act on at once: a key revoked, a tenant or its quotas
changed (caches), a batch stopped (its lines held by whichever replica runs them).

The admin service announces each cache change once (`AuthService.announce`) after its transaction
commits, and the Batch API announces a cancelled or tenant-stopped batch once its status is
committed; the bus delivers each to every replica's handlers:

- `LocalBus`: to the handlers in this process, at once (the single-process default).
- `RedisBus`: here at once, and to the other replicas through Redis pub/sub (a message takes
  about a millisecond). A replica whose subscription breaks drops its whole cache, when the break
  is noticed and again once resubscribed, since it may have missed changes meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Literal, Protocol

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

SUBSCRIBE_WAIT_S = 5.0
RESUBSCRIBE_DELAY_S = 0.5


class Change(msgspec.Struct, frozen=True):
    """`key`: a key id revoked or rotated; `tenant`: a tenant id changed or deleted; `key_created`:
    the hash of a new key (no longer an unknown key); `everything`: drop the whole cache;
    `batch_stopped`: a batch id now cancelling (its lines queued or running anywhere end now).
    Handlers ignore the kinds they do not act on."""

    kind: Literal["key", "tenant", "key_created", "everything", "batch_stopped"]
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
        self._channel = channel
        self._listener: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    async def publish(self, change: Change) -> None:
        self.deliver(change)
        try:
            await self._client.publish(self._channel, msgspec.json.encode(change))
        except RedisError as exc:
            # Committed already; the other replicas see it at their cache TTL, or sooner when
            # their own subscription broke too (they then drop everything).
            log.error("shared state: could not announce %s %s to the other replicas: %s",
                      change.kind, change.ident, exc)

    async def start(self) -> None:
        self._listener = asyncio.get_running_loop().create_task(self._listen())
        try:
            await asyncio.wait_for(self._subscribed.wait(), SUBSCRIBE_WAIT_S)
        except TimeoutError:
            log.error("shared state: no subscription to %s yet; retrying in the background", self._channel)

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None

    async def _listen(self) -> None:
        missed = False
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        self._subscribed.set()
                        if missed:
                            self.deliver(Change("everything"))
                            missed = False
                    elif message["type"] == "message":
                        self._received(message["data"])
            except (RedisError, OSError) as exc:
                if not missed:
                    log.warning("shared state: invalidation subscription lost (%s); resubscribing", exc)
                missed = True
                self.deliver(Change("everything"))
                await asyncio.sleep(RESUBSCRIBE_DELAY_S)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    def _received(self, data: bytes) -> None:
        try:
            change = msgspec.json.decode(data, type=Change)
        except msgspec.DecodeError:
            log.warning("shared state: ignoring a malformed invalidation on %s", self._channel)
            return
        self.deliver(change)
