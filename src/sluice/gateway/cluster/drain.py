"""A gateway process's drain: what SIGTERM does (docs/scale-out.md, "Draining and rolling restarts").

A replica that is being stopped on purpose (a rolling restart, a scale-down, a deploy) should
cost its clients nothing. On SIGTERM it

1. stops taking new work: a new generation POST gets 503 `replica_draining` with `Retry-After`
   (a client retries, a load balancer or `sluice.client` tries another replica), while attaching
   to a stream that exists (GET .../events, an Idempotency-Key re-POST) is still served; `/health`
   and `/ready` answer 503 `draining`, so a load balancer moves away before the port closes;
2. leaves the Kafka consumer group at once (commits, then LeaveGroup): batch partitions move to
   the other replicas now, not a session timeout later, and no new batch line starts here only to
   be cut at exit;
3. lets the requests it accepted run to their end, for at most `[gateway] drain_timeout_s`;
4. closes what is left (their logs end with `stream_interrupted`), and exits 0 (not a crash: the
   supervisor of `sluice serve --replicas` restarts it at once, without backoff).

A second SIGTERM, or SIGINT, stops at once (as before drains existed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from sluice.gateway.edge.errors import OpenAIError

log = logging.getLogger(__name__)

POLL_S = 0.1


def draining_error() -> OpenAIError:
    return OpenAIError(
        503,
        "This gateway replica is shutting down and takes no new requests; retry (another replica takes it).",
        type="server_error",
        code="replica_draining",
        headers={"retry-after": "1"},
    )


class Drain:
    """Whether this process still takes new requests; `run` is the drain sequence (module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        if not 0 <= timeout_s < float("inf"):
            raise ValueError(f"gateway.drain_timeout_s must be zero or positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.draining = False

    def refuse_new(self) -> None:
        """Raises the 503 for a request that would start new work while draining."""
        if self.draining:
            raise draining_error()

    async def run(
        self,
        open_requests: Callable[[], int],
        stop_consuming: Callable[[], Awaitable[None]],
        close_rest: Callable[[], Awaitable[None]],
    ) -> None:
        """Stop taking work, leave the consumer group, wait for `open_requests()` to reach 0 (at most
        `timeout_s`), then `close_rest()`. Idempotent: a second call returns at once."""
        if self.draining:
            return
        self.draining = True
        started = time.monotonic()
        log.warning("draining (SIGTERM): %d open request(s); new ones get 503 for up to %gs",
                    open_requests(), self.timeout_s)
        await stop_consuming()
        deadline = started + self.timeout_s
        while open_requests() and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        left = open_requests()
        if left:
            log.warning("drain timeout (%gs): closing %d open request(s)", self.timeout_s, left)
        else:
            log.warning("drained in %.1fs: every open request finished", time.monotonic() - started)
        await close_rest()


__all__ = ["Drain", "draining_error"]
