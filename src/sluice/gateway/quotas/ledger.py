"""The quota ledger: where admission counters live, behind one interface with two kinds.

`QuotaService` (gateway/quotas/service.py) owns the policy (per-request caps, error messages, headers);
a ledger owns the counters and does each check-and-update as one atomic step:

- `LocalLedger` (here): in this process; exact for one gateway (the single-process default).
- `RedisLedger` (gateway/quotas/redis_ledger.py): in Redis through Lua scripts; exact across replicas,
  each hold under its replica's lease.

Both keep the same counters per tenant: admissions in a sliding 60 s window, tokens in that
window (reserved prompt + max_tokens, replaced by the real count at settlement), the UTC day's
used and reserved tokens (seeded once from the database by `seed_day`), and live (queued +
running) and queued holds.
"""

from __future__ import annotations

import datetime as dt
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from sluice.gateway.quotas.service import QuotaLimits

WINDOW_S = 60.0

RefusedLimit = Literal["concurrent", "queued", "requests", "tokens", "day"]


@dataclass(frozen=True, slots=True)
class Ask:
    """One admission: reserve `need` tokens for `tenant_id` on `day` under `limits`."""

    tenant_id: str
    limits: QuotaLimits
    need: int
    day: dt.date


@dataclass(frozen=True, slots=True)
class Refusal:
    limit: RefusedLimit
    wait_s: float = 0.0  # requests / tokens: until enough leaves the window
    day_left: int = 0  # day: tokens left today


@dataclass(frozen=True, slots=True)
class DayUnseeded:
    """The day's usage is not known yet: load it from the database, `seed_day`, admit again."""


@dataclass(frozen=True, slots=True)
class WindowView:
    """The minute window of a tenant, for the `x-ratelimit-*` headers."""

    requests: int = 0
    requests_reset_s: float = 0.0
    tokens: int = 0
    tokens_reset_s: float = 0.0


Outcome = str | Refusal | DayUnseeded  # a hold id when admitted


class QuotaLedger(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def admit(self, ask: Ask) -> Outcome:
        """Checks every limit and, when all pass, records the hold, in one atomic step."""
        ...

    async def seed_day(self, tenant_id: str, day: dt.date, used: int) -> None:
        """Sets the day's used tokens unless they are known already (first writer wins)."""
        ...

    def mark_running(self, tenant_id: str, hold: str) -> None:
        """The hold is no longer queued."""
        ...

    def finish(self, tenant_id: str, hold: str, used: int) -> None:
        """Ends the hold: charge `used` tokens instead of its reservation."""
        ...

    def view(self, tenant_id: str) -> WindowView: ...

    def live(self, tenant_id: str) -> tuple[int, int]:
        """(queued + running, queued) holds of a tenant taken by this process."""
        ...

    async def finished(self, hold: str) -> None:
        """Waits until `finish` of this hold has reached the store."""
        ...

    async def flush(self) -> None:
        """Waits until every `mark_running` / `finish` so far has reached the store."""
        ...

    async def alive(self, replica: str) -> bool:
        """Whether another gateway replica sharing this ledger holds a live lease (e.g. the
        creator of a batch still being queued). Callers compare with their own id first."""
        ...


# ---- in-process ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _TokenEntry:
    at: float  # clock time of the admission
    tokens: int  # reserved, then the actual count once settled


@dataclass(slots=True)
class _TenantState:
    requests: deque[float] = field(default_factory=deque)  # admission times in the window
    tokens: deque[_TokenEntry] = field(default_factory=deque)
    tokens_in_window: int = 0
    day: dt.date | None = None
    day_used: int = 0  # settled tokens of `day` (database + this process)
    day_reserved: int = 0  # in-flight reservations not yet settled
    live: int = 0  # admitted and not settled: queued + running
    queued: int = 0  # admitted and no token yet

    def expire(self, now: float) -> None:
        horizon = now - WINDOW_S
        while self.requests and self.requests[0] <= horizon:
            self.requests.popleft()
        while self.tokens and self.tokens[0].at <= horizon:
            self.tokens_in_window -= self.tokens.popleft().tokens

    def token_wait(self, need: int, limit: int, now: float) -> float:
        freed = 0
        for entry in self.tokens:
            freed += entry.tokens
            if self.tokens_in_window - freed + need <= limit:
                return entry.at + WINDOW_S - now
        return WINDOW_S


@dataclass(slots=True)
class _Hold:
    state: _TenantState
    entry: _TokenEntry
    need: int
    day: dt.date
    reserved_day: bool  # the day was known at admission, so `need` counts in its day_reserved
    running: bool = False


class LocalLedger:
    """Counters in this process. Every method is synchronous after its await points, so no other
    coroutine interleaves between a check and its update."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[str, _TenantState] = {}
        self._holds: dict[str, _Hold] = {}
        self._ids = itertools.count(1)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def _state(self, tenant_id: str) -> _TenantState:
        state = self._states.get(tenant_id)
        if state is None:
            state = self._states[tenant_id] = _TenantState()
        return state

    async def admit(self, ask: Ask) -> Outcome:
        limits, need = ask.limits, ask.need
        state = self._state(ask.tenant_id)
        if limits.tokens_per_day is not None and state.day != ask.day:
            return DayUnseeded()
        now = self._clock()
        state.expire(now)
        if limits.max_concurrent is not None and state.live >= limits.max_concurrent:
            return Refusal("concurrent")
        if limits.max_queued is not None and state.queued >= limits.max_queued:
            return Refusal("queued")
        if limits.requests_per_minute is not None and len(state.requests) >= limits.requests_per_minute:
            return Refusal("requests", wait_s=state.requests[0] + WINDOW_S - now)
        if limits.tokens_per_minute is not None and state.tokens_in_window + need > limits.tokens_per_minute:
            return Refusal("tokens", wait_s=state.token_wait(need, limits.tokens_per_minute, now))
        if limits.tokens_per_day is not None:
            left = limits.tokens_per_day - state.day_used - state.day_reserved
            if need > left:
                return Refusal("day", day_left=max(0, left))
        entry = _TokenEntry(now, need)
        state.requests.append(now)
        state.tokens.append(entry)
        state.tokens_in_window += need
        reserved_day = state.day == ask.day
        state.day_reserved += need if reserved_day else 0
        state.live += 1
        state.queued += 1
        hold = str(next(self._ids))
        self._holds[hold] = _Hold(state, entry, need, ask.day, reserved_day)
        return hold

    async def seed_day(self, tenant_id: str, day: dt.date, used: int) -> None:
        state = self._state(tenant_id)
        if state.day != day:
            # reservations made on the previous day settle against it; the new day starts clean
            state.day, state.day_used, state.day_reserved = day, used, 0

    def mark_running(self, tenant_id: str, hold: str) -> None:
        found = self._holds.get(hold)
        if found is not None and not found.running:
            found.running = True
            found.state.queued -= 1

    def finish(self, tenant_id: str, hold: str, used: int) -> None:
        found = self._holds.pop(hold, None)
        if found is None:
            return
        state, entry = found.state, found.entry
        if not found.running:
            state.queued -= 1
        state.live -= 1
        if state.tokens and state.tokens[0].at <= entry.at:  # still inside the minute window
            state.tokens_in_window += used - entry.tokens
        entry.tokens = used
        if state.day == found.day:
            state.day_reserved -= found.need if found.reserved_day else 0
            state.day_used += used

    def view(self, tenant_id: str) -> WindowView:
        state = self._states.get(tenant_id)
        if state is None:
            return WindowView()
        now = self._clock()
        state.expire(now)
        return WindowView(
            requests=len(state.requests),
            requests_reset_s=(state.requests[0] + WINDOW_S - now) if state.requests else 0.0,
            tokens=state.tokens_in_window,
            tokens_reset_s=(state.tokens[0].at + WINDOW_S - now) if state.tokens else 0.0,
        )

    def live(self, tenant_id: str) -> tuple[int, int]:
        state = self._states.get(tenant_id)
        return (state.live, state.queued) if state else (0, 0)

    async def finished(self, hold: str) -> None:
        return None

    async def flush(self) -> None:
        return None

    async def alive(self, replica: str) -> bool:
        """In this process: no other replica shares these counters (the only one alive is the
        caller itself, which knows its own id)."""
        return False
