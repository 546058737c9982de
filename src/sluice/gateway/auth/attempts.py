"""Failed admin sign-ins, per source address: guessing the admin token is slowed down and seen.

After `max_failures` (`[admin] max_failed_sign_ins`, default `MAX_FAILURES`) wrong admin tokens
from one address within `WINDOW_S` (on `/console/login` or as an `/admin` bearer token), that
address gets 429 with `retry-after` on both until the oldest failure leaves the window; the right
token is refused too meanwhile, so a guesser cannot tell.
Each failure is logged (WARNING, the address only) and audited (`admin.sign_in_failed`) while the
address is under the limit, so the audit log holds at most `MAX_FAILURES` rows per address and
minute however fast it guesses. Counted per gateway process (each replica holds its own window).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable

from sluice.gateway.edge.errors import OpenAIError

log = logging.getLogger(__name__)

MAX_FAILURES = 10
WINDOW_S = 60.0
MAX_SOURCES = 100_000  # addresses tracked at once; the oldest is forgotten beyond


class FailedSignIns:
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

    def check(self, source: str) -> None:
        """429 while `source` has `MAX_FAILURES` failures in the window."""
        found = self._window(source)
        if found is not None and len(found) >= self.max_failures:
            wait = max(1, math.ceil(found[0] + WINDOW_S - self._clock()))
            raise OpenAIError(429, f"Too many failed admin sign-ins from your address; retry in {wait}s.",
                              type="requests", code="too_many_sign_in_attempts", headers={"retry-after": str(wait)})

    def failed(self, source: str, via: str) -> bool:
        """Records a failure; True when it should be audited (the source was under the limit)."""
        found = self._window(source)
        if found is None:
            if len(self._failures) >= MAX_SOURCES:
                del self._failures[next(iter(self._failures))]
            found = self._failures[source] = deque()
        found.append(self._clock())
        log.warning("failed admin sign-in from %s via %s (%d in the last minute)", source, via, len(found))
        return len(found) <= self.max_failures
