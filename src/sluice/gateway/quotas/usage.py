"""Token usage per tenant, model and UTC day (table usage_daily), upserted in batches as requests end."""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
from typing import Any

import msgspec
from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice import telemetry
from sluice.gateway.db.models import UsageDaily

log = logging.getLogger(__name__)


class UsageRow(msgspec.Struct, frozen=True):
    tenant_id: str
    model: str
    day: dt.date
    prompt_tokens: int
    completion_tokens: int
    requests: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


_Key = tuple[str, str, dt.date]  # (tenant_id, model, day)


class UsageService:
    """Usage is coalesced in memory and written behind: every `flush_interval_s` one transaction
    upserts one row per (tenant, model, day) touched since the last flush, however many requests
    ended meanwhile. Per request, an upsert of its own cost more gateway CPU than the rest of the
    request's handling together (profiled at 200 concurrent streams).

    Every read flushes first, so it sees every recorded request. A crash loses at most the last
    interval's increments: usage is bookkeeping written after the response, never what decides
    whether a request is served (quotas keep their own counters in memory).
    """

    def __init__(self, session_factory: async_sessionmaker[AsyncSession], flush_interval_s: float = 0.25) -> None:
        self._sessions = session_factory
        self._interval = flush_interval_s
        self._pending: dict[_Key, list[int]] = {}  # key -> [prompt, completion, requests]
        self._lock = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None

    async def record(
        self,
        tenant_id: str,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        day: dt.date | None = None,
        requests: int = 1,
    ) -> None:
        """Adds one finished (or aborted) request to its day's row (written within the interval);
        `requests` 0 for a further choice of an n > 1 answer (its tokens count, the request once)."""
        key = (tenant_id, model, day or dt.datetime.now(dt.UTC).date())
        totals = self._pending.setdefault(key, [0, 0, 0])
        totals[0] += prompt_tokens
        totals[1] += completion_tokens
        totals[2] += requests
        telemetry.USAGE_PENDING.set(len(self._pending))
        if self._timer is None or self._timer.done():
            self._timer = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        """Flushes every interval while anything is pending (including what arrived mid-flush)."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.flush()
            except Exception:
                log.error("could not write usage; kept for the next flush", exc_info=True)
            if not self._pending:
                return

    async def flush(self) -> None:
        """Writes everything recorded so far (on failure it stays pending and the error propagates)."""
        async with self._lock:
            pending, self._pending = self._pending, {}
            if not pending:
                return
            rows = [{"tenant_id": t, "model": m, "day": d, "prompt_tokens": p, "completion_tokens": c,
                     "requests": n} for (t, m, d), (p, c, n) in pending.items()]
            try:
                async with self._sessions() as session, session.begin():
                    dialect = session.bind.dialect.name if session.bind is not None else "sqlite"
                    await session.execute(_upsert(dialect), rows)
            except BaseException:
                for key, (p, c, n) in pending.items():  # merge back: nothing recorded is dropped
                    totals = self._pending.setdefault(key, [0, 0, 0])
                    totals[0] += p
                    totals[1] += c
                    totals[2] += n
                telemetry.USAGE_WRITE_FAILURES.inc()
                raise
            finally:
                telemetry.USAGE_PENDING.set(len(self._pending))

    async def close(self) -> None:
        """Final flush at shutdown."""
        if self._timer is not None:
            self._timer.cancel()
        await self.flush()

    async def day_total(self, tenant_id: str, day: dt.date) -> int:
        """Prompt + completion tokens of a tenant on one UTC day, all models."""
        await self.flush()
        async with self._sessions() as session:
            total = await session.scalar(
                select(
                    func.coalesce(func.sum(UsageDaily.prompt_tokens + UsageDaily.completion_tokens), 0)
                ).where(UsageDaily.tenant_id == tenant_id, UsageDaily.day == day)
            )
        return int(total or 0)

    async def query(
        self, tenant_id: str | None, start: dt.date | None, end: dt.date | None
    ) -> list[UsageRow]:
        """Rows between `start` and `end` inclusive; `tenant_id=None` = every tenant (admin only)."""
        await self.flush()
        statement = select(UsageDaily).order_by(UsageDaily.day, UsageDaily.tenant_id, UsageDaily.model)
        if tenant_id is not None:
            statement = statement.where(UsageDaily.tenant_id == tenant_id)
        if start is not None:
            statement = statement.where(UsageDaily.day >= start)
        if end is not None:
            statement = statement.where(UsageDaily.day <= end)
        async with self._sessions() as session:
            rows = (await session.execute(statement)).scalars().all()
        return [
            UsageRow(r.tenant_id, r.model, r.day, r.prompt_tokens, r.completion_tokens, r.requests)
            for r in rows
        ]


@functools.cache
def _upsert(dialect: str) -> Any:
    """One statement for many rows (executemany), built once per dialect so it compiles once."""
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    statement = insert(UsageDaily)
    excluded = statement.excluded
    return statement.on_conflict_do_update(
        index_elements=["tenant_id", "model", "day"],
        set_={
            "prompt_tokens": UsageDaily.prompt_tokens + excluded.prompt_tokens,
            "completion_tokens": UsageDaily.completion_tokens + excluded.completion_tokens,
            "requests": UsageDaily.requests + excluded.requests,
        },
    )
