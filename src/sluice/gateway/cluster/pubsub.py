"""One Redis pub/sub channel heard for a replica's whole life, whatever happens to the connection.

The invalidation bus (gateway/cluster/invalidation.py) and the worker-slot release announcements
(gateway/dispatch/slots.py) each listen to one channel for as long as the replica runs. Redis may drop the
connection at any time (a restart, a client kill, the network); that must cost at most the
messages sent meanwhile, never the listening itself. `Subscription` is the loop both need:
subscribe, hand each message to a callback, and on a lost connection log once, tell the owner (it
may have missed messages) and resubscribe after a capped, doubling delay, logging once more when
it hears the channel again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

RESUBSCRIBE_FIRST_S = 0.1  # the first retry after a loss: a killed connection usually comes back at once
RESUBSCRIBE_MAX_S = 2.0  # the longest wait between tries while Redis stays away


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancels a background loop and waits until it has ended (what each loop's `stop` does)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _ignore() -> None:
    return None


class Subscription:
    """Listens to `channel` on `client` in a background task from `start()` to `stop()`.

    `on_message(data)` runs for every message; `on_lost()` each time the connection is found gone
    (messages may have been missed); `on_back()` once the channel is heard again after a loss.
    `client` should not retry behind our back: a silent reconnect would hide missed messages."""

    def __init__(self, client: Redis, channel: str, on_message: Callable[[bytes], None], *, what: str,
                 on_lost: Callable[[], None] = _ignore, on_back: Callable[[], None] = _ignore) -> None:
        self._client = client
        self.channel = channel
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_back = on_back
        self._what = what  # in the log lines: "shared state: subscription to <what> lost ..."
        self._task: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()  # set once the first subscription is confirmed

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._listen(), name=f"subscription-{self._what}")

    async def wait_subscribed(self, timeout_s: float) -> bool:
        """Whether the subscription was confirmed within `timeout_s` (it goes on trying either way)."""
        try:
            await asyncio.wait_for(self.subscribed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _listen(self) -> None:
        lost = False
        delay_s = RESUBSCRIBE_FIRST_S
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        self.subscribed.set()
                        delay_s = RESUBSCRIBE_FIRST_S
                        if lost:
                            lost = False
                            log.info("shared state: subscription to %s back", self._what)
                            self._on_back()
                    elif message["type"] == "message":
                        self._on_message(message["data"])
            except (RedisError, OSError) as exc:
                if not lost:
                    log.warning("shared state: subscription to %s lost (%s); resubscribing", self._what, exc)
                lost = True
                self._on_lost()
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, RESUBSCRIBE_MAX_S)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
