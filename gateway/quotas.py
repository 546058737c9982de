"""Per-tenant quotas, enforced at admission; exact within one gateway process.

Limits (None = unlimited): requests/min and tokens/min over a sliding 60 s window, tokens per UTC
day (the day's total read from usage_daily once, then kept in memory), concurrent requests
(queued + running), queued requests (admitted, no token yet), and the per-request caps
max_prompt_tokens / max_output_tokens (400: no retry helps).

A request that can never be admitted — prompt + max_tokens above the tokens-per-minute limit, or
above what is left of the daily budget — is a 429 with `x-should-retry: false` and no `retry-after`
(the OpenAI SDKs honour that header and do not retry); the message says what to change.

A `Reservation` holds prompt + max_tokens against the minute and day budgets from admission until
`settle` (actual tokens) or `release` (full refund). All bookkeeping after the optional day load
is synchronous, so no other coroutine can interleave between a check and its update.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluice.gateway.errors import OpenAIError
from sluice.protocol import Priority

if TYPE_CHECKING:
    from sluice.gateway.auth import TenantContext

WINDOW_S = 60.0
MAX_RETRY_AFTER_S = 60

DayLoader = Callable[[str, dt.date], Awaitable[int]]


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    max_concurrent: int | None = None
    max_queued: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None

    @classmethod
    def from_row(cls, row: Any | None) -> QuotaLimits:
        if row is None:
            return cls()
        return cls(**{name: getattr(row, name) for name in cls.__slots__})


_QUOTA_TYPES = {"insufficient_quota": "insufficient_quota", "request_too_large": "tokens"}


class QuotaExceeded(OpenAIError):
    """429: `rate_limit_exceeded` (retry after `retry_after` s), or with `retry_after=None` one that
    no retry helps (`insufficient_quota`, `request_too_large`): `x-should-retry: false`."""

    def __init__(
        self,
        message: str,
        *,
        code: str,
        retry_after: int | None,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        extra = dict(headers or {})
        if retry_after is not None:
            extra["retry-after"] = str(retry_after)
        else:
            extra["x-should-retry"] = "false"
        super().__init__(
            429, message, type=_QUOTA_TYPES.get(code, "requests"), param=param, code=code, headers=extra
        )
        self.retry_after = retry_after


@dataclass(slots=True)
class _TokenEntry:
    at: float  # monotonic admission time
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
    day_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def expire(self, now: float) -> None:
        horizon = now - WINDOW_S
        while self.requests and self.requests[0] <= horizon:
            self.requests.popleft()
        while self.tokens and self.tokens[0].at <= horizon:
            self.tokens_in_window -= self.tokens.popleft().tokens


@dataclass(slots=True)
class Reservation:
    tenant_id: str
    priority: Priority
    prompt_tokens: int
    max_tokens: int
    day: dt.date
    _entry: _TokenEntry
    _state: _TenantState
    running: bool = False
    done: bool = False

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


def _ceil_s(seconds: float) -> int:
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))


def _retry_later(message: str, *, wait: float, headers: dict[str, str]) -> QuotaExceeded:
    """A minute-window 429 whose message and retry-after header give the same whole seconds."""
    retry_after = _ceil_s(wait)
    return QuotaExceeded(
        f"{message} Retry in {retry_after}s.", code="rate_limit_exceeded", retry_after=retry_after, headers=headers
    )


def format_reset(seconds: float) -> str:
    """OpenAI's style: `850ms`, `12s`, `1m0s`."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    minutes, secs = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


class QuotaService:
    def __init__(
        self, day_loader: DayLoader | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._states: dict[str, _TenantState] = {}
        self._day_loader = day_loader
        self._clock = clock

    def _state(self, tenant_id: str) -> _TenantState:
        state = self._states.get(tenant_id)
        if state is None:
            state = self._states[tenant_id] = _TenantState()
        return state

    async def _ensure_day(self, tenant_id: str, state: _TenantState, today: dt.date) -> None:
        if state.day == today:
            return
        async with state.day_lock:
            if state.day == today:
                return
            used = await self._day_loader(tenant_id, today) if self._day_loader is not None else 0
            state.day, state.day_used = today, used
            # reservations made on the previous day settle against it; the new day starts clean
            state.day_reserved = 0

    def check_request_size(self, tenant: TenantContext, prompt_tokens: int, max_tokens: int) -> None:
        """Per-request caps: 400, because waiting would not help."""
        limits = tenant.limits
        if limits.max_prompt_tokens is not None and prompt_tokens > limits.max_prompt_tokens:
            raise OpenAIError(
                400,
                f"The prompt has {prompt_tokens} tokens; your limit is "
                f"{limits.max_prompt_tokens} prompt tokens per request.",
                param="messages",
                code="context_length_exceeded",
            )
        if limits.max_output_tokens is not None and max_tokens > limits.max_output_tokens:
            raise OpenAIError(
                400,
                f"max_tokens is {max_tokens}; your limit is {limits.max_output_tokens} "
                "output tokens per request.",
                param="max_tokens",
                code="max_tokens_exceeded",
            )

    async def admit(
        self, tenant: TenantContext, prompt_tokens: int, max_tokens: int, priority: Priority
    ) -> Reservation:
        """Checks every limit and reserves prompt + max_tokens; raises OpenAIError / QuotaExceeded."""
        self.check_request_size(tenant, prompt_tokens, max_tokens)
        limits = tenant.limits
        state = self._state(tenant.id)
        today = dt.datetime.now(dt.UTC).date()
        if limits.tokens_per_day is not None:
            await self._ensure_day(tenant.id, state, today)
        # ---- from here on: no await, so check-then-update is atomic on the event loop ----
        now = self._clock()
        state.expire(now)
        need = prompt_tokens + max_tokens
        headers = self.headers(tenant)
        if limits.max_concurrent is not None and state.live >= limits.max_concurrent:
            raise QuotaExceeded(
                f"Too many concurrent requests: your limit is {limits.max_concurrent} "
                "queued or running at once.",
                code="rate_limit_exceeded",
                retry_after=1,
                headers=headers,
            )
        if limits.max_queued is not None and state.queued >= limits.max_queued:
            raise QuotaExceeded(
                f"Too many queued requests: your limit is {limits.max_queued}.",
                code="rate_limit_exceeded",
                retry_after=1,
                headers=headers,
            )
        if limits.requests_per_minute is not None and len(state.requests) >= limits.requests_per_minute:
            raise _retry_later(
                f"Rate limit reached: {limits.requests_per_minute} requests per minute.",
                wait=state.requests[0] + WINDOW_S - now,
                headers=headers,
            )
        if limits.tokens_per_minute is not None:
            if need > limits.tokens_per_minute:
                raise QuotaExceeded(
                    f"Request too large: prompt + max_tokens is {need} tokens, more than your limit of "
                    f"{limits.tokens_per_minute} tokens per minute, so it can never be admitted; "
                    "lower max_tokens or shorten the prompt (retrying does not help).",
                    code="request_too_large",
                    retry_after=None,
                    headers=headers,
                    param="max_tokens",
                )
            if state.tokens_in_window + need > limits.tokens_per_minute:
                raise _retry_later(
                    f"Rate limit reached: {limits.tokens_per_minute} tokens per minute "
                    "(prompt + max_tokens reserved).",
                    wait=self._token_wait(state, need, limits.tokens_per_minute, now),
                    headers=headers,
                )
        if limits.tokens_per_day is not None:
            left = limits.tokens_per_day - state.day_used - state.day_reserved
            if need > left:
                raise QuotaExceeded(
                    f"You exceeded your daily token budget ({limits.tokens_per_day} tokens per "
                    f"UTC day; {max(0, left)} left, this request needs {need}).",
                    code="insufficient_quota",
                    retry_after=None,
                    headers=headers,
                )
        entry = _TokenEntry(now, need)
        state.requests.append(now)
        state.tokens.append(entry)
        state.tokens_in_window += need
        state.day_reserved += need if state.day == today else 0
        state.live += 1
        state.queued += 1
        return Reservation(tenant.id, priority, prompt_tokens, max_tokens, today, entry, state)

    @staticmethod
    def _token_wait(state: _TenantState, need: int, limit: int, now: float) -> float:
        freed = 0
        for entry in state.tokens:
            freed += entry.tokens
            if state.tokens_in_window - freed + need <= limit:
                return entry.at + WINDOW_S - now
        return WINDOW_S

    def mark_running(self, reservation: Reservation) -> None:
        """The first token arrived: the request no longer counts as queued."""
        if not reservation.running and not reservation.done:
            reservation.running = True
            reservation._state.queued -= 1

    def settle(self, reservation: Reservation, prompt_tokens: int, completion_tokens: int) -> None:
        """The request ended: charge what it actually used instead of the reservation. Idempotent."""
        self._finish(reservation, prompt_tokens + completion_tokens)

    def release(self, reservation: Reservation) -> None:
        """The request never ran (rejected downstream): refund the whole reservation. Idempotent."""
        self._finish(reservation, 0)

    def _finish(self, reservation: Reservation, used: int) -> None:
        if reservation.done:
            return
        state = reservation._state
        if not reservation.running:
            state.queued -= 1
        reservation.done = True
        state.live -= 1
        entry = reservation._entry
        if state.tokens and state.tokens[0].at <= entry.at:  # still inside the minute window
            state.tokens_in_window += used - entry.tokens
        entry.tokens = used
        if state.day == reservation.day:
            state.day_reserved -= reservation.reserved_tokens
            state.day_used += used

    def headers(self, tenant: TenantContext) -> dict[str, str]:
        """`x-ratelimit-*` for the configured minute limits (sent on every authenticated answer)."""
        limits = tenant.limits
        state = self._states.get(tenant.id)
        now = self._clock()
        if state is not None:
            state.expire(now)
        out: dict[str, str] = {}
        if limits.requests_per_minute is not None:
            used = len(state.requests) if state else 0
            reset = (state.requests[0] + WINDOW_S - now) if state and state.requests else 0.0
            out["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
            out["x-ratelimit-remaining-requests"] = str(max(0, limits.requests_per_minute - used))
            out["x-ratelimit-reset-requests"] = format_reset(reset)
        if limits.tokens_per_minute is not None:
            used = state.tokens_in_window if state else 0
            reset = (state.tokens[0].at + WINDOW_S - now) if state and state.tokens else 0.0
            out["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
            out["x-ratelimit-remaining-tokens"] = str(max(0, limits.tokens_per_minute - used))
            out["x-ratelimit-reset-tokens"] = format_reset(reset)
        return out

    def live(self, tenant_id: str) -> tuple[int, int]:
        """(queued + running, queued) of a tenant in this process."""
        state = self._states.get(tenant_id)
        return (state.live, state.queued) if state else (0, 0)
