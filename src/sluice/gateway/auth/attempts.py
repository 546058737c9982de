"""Failed admin sign-ins, per source address: guessing the admin token is slowed down and seen.

After `max_failures` (`[admin] max_failed_sign_ins`, default `MAX_FAILURES`) wrong admin tokens
from one address within `WINDOW_S` (on `/console/login` or as an `/admin` bearer token), that
address gets 429 with `retry-after` on both until the oldest failure leaves the window; the right
token is refused too meanwhile, so a guesser cannot tell.
Each failure is logged (WARNING, the address only) and audited (`admin.sign_in_failed`) while the
address is under the limit, so the audit log holds at most `MAX_FAILURES` rows per address and
minute however fast it guesses.

Counted in this process (`FailedSignIns`) or, with shared state in Redis, across the replicas
(`RedisSignIns`: one sliding window per address, one Lua script per check or failure), so
guessing through N replicas earns no N-fold limit. While Redis does not answer, each replica
counts alone (the limit stays, per replica) rather than letting every guess through.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.gateway.edge.errors import OpenAIError

log = logging.getLogger(__name__)

MAX_FAILURES = 10
WINDOW_S = 60.0
MAX_SOURCES = 100_000  # addresses tracked at once in a process; the oldest is forgotten beyond


class SignInLimiter(Protocol):
    async def check(self, source: str) -> None:
        """429 while `source` has `max_failures` failures in the window."""
        ...

    async def failed(self, source: str, via: str) -> bool:
        """Records a failure; True when it should be audited (the source was under the limit)."""
        ...


def _too_many(wait_s: float) -> OpenAIError:
    wait = max(1, math.ceil(wait_s))
    return OpenAIError(429, f"Too many failed admin sign-ins from your address; retry in {wait}s.",
                       type="requests", code="too_many_sign_in_attempts", headers={"retry-after": str(wait)})


def _logged(source: str, via: str, count: int) -> None:
    log.warning("failed admin sign-in from %s via %s (%d in the last minute)", source, via, count)


class FailedSignIns:
    """This process's windows (one gateway, or the fallback while Redis is away)."""

    def __init__(self, max_failures: int = MAX_FAILURES, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_failures = max_failures
        self._clock = clock
        self._failures: dict[str, deque[float]] = {}

    def _window(self, source: str) -> deque[float] | None:
        found = self._failures.get(source)
        if found is None:
            return None
        horizon = self._clock() - WINDOW_S
        while found and found[0] <= horizon:
            found.popleft()
        if not found:
            del self._failures[source]
            return None
        return found

    async def check(self, source: str) -> None:
        found = self._window(source)
        if found is not None and len(found) >= self.max_failures:
            raise _too_many(found[0] + WINDOW_S - self._clock())

    async def failed(self, source: str, via: str) -> bool:
        found = self._window(source)
        if found is None:
            if len(self._failures) >= MAX_SOURCES:
                del self._failures[next(iter(self._failures))]
            found = self._failures[source] = deque()
        found.append(self._clock())
        _logged(source, via, len(found))
        return len(found) <= self.max_failures


# KEYS: the address's window (a sorted set of failures by Redis time, ms); ARGV: window ms, most
# kept, "1" to record a failure (member: ARGV[4]) or "0" to look. Returns {failures in the window,
# ms until the oldest leaves it}. At most `most` are kept: past the limit only the count matters.
_WINDOW = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], now, ARGV[4])
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[2]) - 1)
  redis.call('PEXPIRE', KEYS[1], window)
end
local count = redis.call('ZCARD', KEYS[1])
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local wait = 0
if #oldest > 0 then wait = tonumber(oldest[2]) + window - now end
return {count, wait}
"""


class RedisSignIns:
    """The windows in Redis under `P:signin:<address>`, shared by the replicas."""

    def __init__(self, client: Redis, *, prefix: str, max_failures: int = MAX_FAILURES) -> None:
        self.max_failures = max_failures
        self._prefix = prefix
        self._script = client.register_script(_WINDOW)
        self._fallback = FailedSignIns(max_failures)

    async def _window(self, source: str, record: bool) -> tuple[int, float]:
        count, wait_ms = await self._script(
            keys=[f"{self._prefix}:signin:{source}"],
            args=[int(WINDOW_S * 1000), self.max_failures + 1, "1" if record else "0", uuid.uuid4().hex])
        return int(count), int(wait_ms) / 1000

    async def check(self, source: str) -> None:
        try:
            count, wait_s = await self._window(source, record=False)
        except RedisError as exc:
            log.warning("shared state: sign-in window unreadable (%s); counting in this replica", exc)
            await self._fallback.check(source)
            return
        if count >= self.max_failures:
            raise _too_many(wait_s)

    async def failed(self, source: str, via: str) -> bool:
        try:
            count, _ = await self._window(source, record=True)
        except RedisError as exc:
            log.warning("shared state: sign-in window unwritable (%s); counting in this replica", exc)
            return await self._fallback.failed(source, via)
        _logged(source, via, count)
        return count <= self.max_failures
