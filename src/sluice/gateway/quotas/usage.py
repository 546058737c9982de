"""Token usage per tenant, model and UTC day (table usage_daily), upserted in group commits as requests
end, once per request however often it is recorded (table usage_applied)."""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import hashlib
import logging
import math
import time
from typing import Any

import msgspec
from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice import telemetry
from sluice.gateway.db.models import UsageApplied, UsageDaily

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

WAIT_S = 5.0  # `written` waits this long (then the usage stays pending, retried: no answer is held back)
RETRY_MAX_S = 1.0  # the longest wait between two tries of a failing write
PRUNE_EVERY_S = 3600.0  # how often a process deletes usage_applied rows older than KEEP_APPLIED
KEEP_APPLIED = dt.timedelta(days=2)


class _Entry(msgspec.Struct):
    """One request's (or choice's) usage, until a flush has written it."""

    request_id: str
    key: _Key
    prompt_tokens: int
    completion_tokens: int
    requests: int
    written: asyncio.Future[None]


class UsageService:
    """Usage is written behind in group commits: one transaction upserts one usage_daily row per
    (tenant, model, day) touched since the last flush, however many requests ended meanwhile. A
    record starts a flush at once when the last one began `flush_interval_s` ago or more (an answer
    ending on a quiet gateway waits for one commit), else when that interval is up: at most one
    flush per interval, however busy. Per request, an upsert of its own cost
    more gateway CPU than the rest of the request's handling together (profiled at 200 concurrent
    streams).

    Exactly once, through any SIGKILL: `record` returns a future that is done once the usage is
    committed, and a request's answer ends only after it (the stream's [DONE] and its log's end,
    the non-streamed response: `Flight.settled`); a replica that takes a stream over records its
    usage again, and the same transaction that adds a request's tokens inserts its id into
    usage_applied, so a second record of an id already there adds nothing.

    Every read flushes first, so it sees every recorded request. A failed write keeps everything
    for the next flush (usage is bookkeeping, never what decides whether a request is served:
    quotas keep their own counters; `Flight.settled` stops waiting for it after a while).
    """

    def __init__(self, session_factory: async_sessionmaker[AsyncSession], flush_interval_s: float = 0.02) -> None:
        self._sessions = session_factory
        self._interval = flush_interval_s
        self._pending: list[_Entry] = []
        self._lock = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None
        self._pruned_at = 0.0
        self._flushed_at = -math.inf  # monotonic time the last flush began

    def record(
        self,
        request_id: str,
        tenant_id: str,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        day: dt.date | None = None,
        requests: int = 1,
    ) -> asyncio.Future[None]:
        """Adds one finished (or aborted) request to its day's row, once per `request_id` however
        often it is recorded; `requests` 0 for a further choice of an n > 1 answer (its tokens count,
        the request once). The future is done when the row is committed."""
        loop = asyncio.get_running_loop()
        if len(request_id) > 128:
            request_id = hashlib.sha256(request_id.encode()).hexdigest()
        entry = _Entry(request_id, (tenant_id, model, day or dt.datetime.now(dt.UTC).date()), prompt_tokens,
                       completion_tokens, requests, loop.create_future())
        self._pending.append(entry)
        telemetry.USAGE_PENDING.set(len(self._pending))
        if self._timer is None or self._timer.done():
            self._timer = loop.create_task(self._flush_later())
        return entry.written

    async def _flush_later(self) -> None:
        """Flushes while anything is pending (including what arrived mid-flush), one interval after
        the last flush began at the earliest; after a failed write, waits twice as long each time,
        up to `RETRY_MAX_S`."""
        backoff = 0.0
        while True:
            await asyncio.sleep(max(backoff, self._flushed_at + self._interval - time.monotonic()))
            try:
                await self.flush()
                backoff = 0.0
            except Exception:
                log.error("could not write usage; kept for the next flush", exc_info=backoff == 0.0)
                backoff = min(max(backoff * 2, self._interval * 2), RETRY_MAX_S)
            if not self._pending:
                return

    async def flush(self) -> None:
        """Writes everything recorded so far (on failure it stays pending and the error propagates)."""
        async with self._lock:
            pending, self._pending = self._pending, []
            if not pending:
                return
            self._flushed_at = time.monotonic()
            try:
                async with self._sessions() as session, session.begin():
                    dialect = session.bind.dialect.name if session.bind is not None else "sqlite"
                    await self._write(session, dialect, pending)
            except BaseException:
                self._pending[:0] = pending  # nothing recorded is dropped
                telemetry.USAGE_WRITE_FAILURES.inc()
                raise
            finally:
                telemetry.USAGE_PENDING.set(len(self._pending))
            for entry in pending:
                if not entry.written.done():
                    entry.written.set_result(None)

    async def _write(self, session: AsyncSession, dialect: str, pending: list[_Entry]) -> None:
        """In one transaction: the ids not applied yet are inserted into usage_applied, and their
        tokens are added to usage_daily, the rows in key order (two replicas' flushes lock them in
        the same order: no deadlock)."""
        ids = {entry.request_id: entry.key[2] for entry in pending}
        inserted = await session.scalars(_mark(dialect), [{"request_id": r, "day": d} for r, d in ids.items()])
        fresh = set(inserted.all())
        totals: dict[_Key, list[int]] = {}
        for entry in pending:
            if entry.request_id in fresh:
                fresh.discard(entry.request_id)  # recorded twice within this flush: once
                row = totals.setdefault(entry.key, [0, 0, 0])
                row[0] += entry.prompt_tokens
                row[1] += entry.completion_tokens
                row[2] += entry.requests
        if totals:
            rows = [{"tenant_id": t, "model": m, "day": d, "prompt_tokens": p, "completion_tokens": c,
                     "requests": n} for (t, m, d), (p, c, n) in sorted(totals.items())]
            await session.execute(_upsert(dialect), rows)
        now = time.monotonic()
        if now - self._pruned_at > PRUNE_EVERY_S:
            self._pruned_at = now
            oldest = dt.datetime.now(dt.UTC).date() - KEEP_APPLIED
            await session.execute(delete(UsageApplied).where(UsageApplied.day < oldest))

    @staticmethod
    async def written(future: asyncio.Future[None] | None, request_id: str) -> None:
        """Until `record`'s future is done, for `WAIT_S` at most (a database that refuses writes
        does not hold answers back; the usage stays pending and is retried)."""
        if future is None or future.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(future), WAIT_S)
        except TimeoutError:
            log.warning("usage of %s not written within %.0f s; kept pending", request_id, WAIT_S)

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
def _mark(dialect: str) -> Any:
    """Inserts request ids into usage_applied; returns those that were not there."""
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    return insert(UsageApplied).on_conflict_do_nothing(index_elements=["request_id"]).returning(
        UsageApplied.request_id)


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
