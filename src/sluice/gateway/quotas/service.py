"""Per-tenant quotas, enforced at admission; exact within one gateway process, or across replicas
when the counters live in Redis (`[shared] url`, see gateway/quotas/ledger.py and docs/scale-out.md).

Limits (None = unlimited): requests/min and tokens/min over a sliding 60 s window, tokens per UTC
day (the day's total read from usage_daily once, then kept in the ledger), concurrent requests
(queued + running), queued requests (admitted, no token yet), and the per-request caps
max_prompt_tokens / max_output_tokens (400: no retry helps).

A request that can never be admitted — prompt + max_tokens above the tokens-per-minute limit, or
above what is left of the daily budget — is a 429 with `x-should-retry: false` and no `retry-after`
(the OpenAI SDKs honour that header and do not retry); the message says what to change.

A `Reservation` holds prompt + max_tokens against the minute and day budgets from admission until
`settle` (actual tokens) or `release` (full refund). Each check-and-update is one atomic step of
the ledger; `mark_running`, `settle` and `release` return at once (a shared ledger applies them in
the background: `flush` waits for them).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.quotas.ledger import Ask, DayUnseeded, LocalLedger, QuotaLedger, Refusal
from sluice.protocol import Priority

if TYPE_CHECKING:
    from sluice.gateway.auth.service import TenantContext

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
class Reservation:
    tenant_id: str
    priority: Priority
    prompt_tokens: int
    max_tokens: int
    day: dt.date
    hold: str  # the ledger's id of this hold
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
    """The quota policy over a ledger (gateway/quotas/ledger.py): in-process by default, Redis when shared."""

    def __init__(
        self,
        day_loader: DayLoader | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        ledger: QuotaLedger | None = None,
    ) -> None:
        self._day_loader = day_loader
        self._ledger: QuotaLedger = ledger if ledger is not None else LocalLedger(clock)

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

    def precheck(self, tenant: TenantContext, pending: int = 0) -> None:
        """Before any expensive work on a request (tokenizing a large prompt): the 429 that admission
        would give on requests/min or concurrency, from this process's view of the counters.
        `pending`: this tenant's requests already waiting for the same work (not admitted yet)."""
        limits = tenant.limits
        if limits.requests_per_minute is not None:
            view = self._ledger.view(tenant.id)
            if view.requests >= limits.requests_per_minute:
                raise self._refused(tenant, Refusal("requests", wait_s=view.requests_reset_s), 0)
        if limits.max_concurrent is not None and self._ledger.live(tenant.id)[0] + pending >= limits.max_concurrent:
            raise self._refused(tenant, Refusal("concurrent"), 0)

    async def count_request(self, tenant: TenantContext, *, refuse: bool = False) -> None:
        """Counts a request against requests/min, reserving no tokens and holding no concurrency
        slot: a request refused after expensive work (a large prompt tokenized, then found over
        the context), or an attach to a stream. Without it a tenant limited to 1 request/min could
        have any number of large prompts tokenized, each refused with 400 and none counted.
        Over the limit: the 429 when `refuse`, else counted as nothing."""
        limits = tenant.limits
        if limits.requests_per_minute is None:
            return
        uncapped = dataclasses.replace(limits, max_concurrent=None, max_queued=None, tokens_per_minute=None,
                                       tokens_per_day=None)
        ask = Ask(tenant.id, uncapped, 0, dt.datetime.now(dt.UTC).date())
        outcome = await self._ledger.admit(ask)
        while isinstance(outcome, DayUnseeded):
            used = await self._day_loader(tenant.id, ask.day) if self._day_loader is not None else 0
            await self._ledger.seed_day(tenant.id, ask.day, used)
            outcome = await self._ledger.admit(ask)
        if isinstance(outcome, Refusal):
            if refuse:
                raise self._refused(tenant, outcome, 0)
            return
        self._ledger.finish(tenant.id, outcome, 0)

    async def admit(
        self, tenant: TenantContext, prompt_tokens: int, max_tokens: int, priority: Priority
    ) -> Reservation:
        """Checks every limit and reserves prompt + max_tokens; raises OpenAIError / QuotaExceeded."""
        self.check_request_size(tenant, prompt_tokens, max_tokens)
        limits = tenant.limits
        need = prompt_tokens + max_tokens
        if limits.tokens_per_minute is not None and need > limits.tokens_per_minute:
            raise QuotaExceeded(
                f"Request too large: prompt + max_tokens is {need} tokens, more than your limit of "
                f"{limits.tokens_per_minute} tokens per minute, so it can never be admitted; "
                "lower max_tokens or shorten the prompt (retrying does not help).",
                code="request_too_large",
                retry_after=None,
                headers=self.headers(tenant),
                param="max_tokens",
            )
        ask = Ask(tenant.id, limits, need, dt.datetime.now(dt.UTC).date())
        outcome = await self._ledger.admit(ask)
        while isinstance(outcome, DayUnseeded):  # once a day per tenant (per process when in-process)
            used = await self._day_loader(tenant.id, ask.day) if self._day_loader is not None else 0
            await self._ledger.seed_day(tenant.id, ask.day, used)
            outcome = await self._ledger.admit(ask)
        if isinstance(outcome, Refusal):
            raise self._refused(tenant, outcome, need)
        return Reservation(tenant.id, priority, prompt_tokens, max_tokens, ask.day, outcome)

    def _refused(self, tenant: TenantContext, refusal: Refusal, need: int) -> QuotaExceeded:
        limits, headers = tenant.limits, self.headers(tenant)
        if refusal.limit == "concurrent":
            return QuotaExceeded(
                f"Too many concurrent requests: your limit is {limits.max_concurrent} "
                "queued or running at once.",
                code="rate_limit_exceeded",
                retry_after=1,
                headers=headers,
            )
        if refusal.limit == "queued":
            return QuotaExceeded(
                f"Too many queued requests: your limit is {limits.max_queued}.",
                code="rate_limit_exceeded",
                retry_after=1,
                headers=headers,
            )
        if refusal.limit == "requests":
            return _retry_later(
                f"Rate limit reached: {limits.requests_per_minute} requests per minute.",
                wait=refusal.wait_s,
                headers=headers,
            )
        if refusal.limit == "tokens":
            return _retry_later(
                f"Rate limit reached: {limits.tokens_per_minute} tokens per minute "
                "(prompt + max_tokens reserved).",
                wait=refusal.wait_s,
                headers=headers,
            )
        return QuotaExceeded(
            f"You exceeded your daily token budget ({limits.tokens_per_day} tokens per "
            f"UTC day; {refusal.day_left} left, this request needs {need}).",
            code="insufficient_quota",
            retry_after=None,
            headers=headers,
        )

    def mark_running(self, reservation: Reservation) -> None:
        """The first token arrived: the request no longer counts as queued."""
        if not reservation.running and not reservation.done:
            reservation.running = True
            self._ledger.mark_running(reservation.tenant_id, reservation.hold)

    def settle(self, reservation: Reservation, prompt_tokens: int, completion_tokens: int) -> None:
        """The request ended: charge what it actually used instead of the reservation. Idempotent."""
        self._finish(reservation, prompt_tokens + completion_tokens)

    def release(self, reservation: Reservation) -> None:
        """The request never ran (rejected downstream): refund the whole reservation. Idempotent."""
        self._finish(reservation, 0)

    def _finish(self, reservation: Reservation, used: int) -> None:
        if not reservation.done:
            reservation.done = True
            self._ledger.finish(reservation.tenant_id, reservation.hold, used)

    def headers(self, tenant: TenantContext) -> dict[str, str]:
        """`x-ratelimit-*` for the configured minute limits (sent on every authenticated answer)."""
        limits = tenant.limits
        out: dict[str, str] = {}
        if limits.requests_per_minute is None and limits.tokens_per_minute is None:
            return out
        view = self._ledger.view(tenant.id)
        if limits.requests_per_minute is not None:
            out["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
            out["x-ratelimit-remaining-requests"] = str(max(0, limits.requests_per_minute - view.requests))
            out["x-ratelimit-reset-requests"] = format_reset(view.requests_reset_s)
        if limits.tokens_per_minute is not None:
            out["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
            out["x-ratelimit-remaining-tokens"] = str(max(0, limits.tokens_per_minute - view.tokens))
            out["x-ratelimit-reset-tokens"] = format_reset(view.tokens_reset_s)
        return out

    def live(self, tenant_id: str) -> tuple[int, int]:
        """(queued + running, queued) of a tenant in this process."""
        return self._ledger.live(tenant_id)

    async def settled(self, reservation: Reservation) -> None:
        """Waits until this reservation's `settle` / `release` has reached the ledger's store, so
        that the client's next request finds the slot free on every replica."""
        await self._ledger.finished(reservation.hold)

    async def flush(self) -> None:
        """Waits until every settlement so far has reached the ledger's store."""
        await self._ledger.flush()
