"""Token usage per tenant, model and UTC day (table usage_daily), upserted as requests end."""

from __future__ import annotations

import datetime as dt
import logging

import msgspec
from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

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


class UsageService:
    def __init__(self, session_factory: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = session_factory

    async def record(
        self,
        tenant_id: str,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        day: dt.date | None = None,
    ) -> None:
        """Adds one finished (or aborted) request to today's row, creating it if needed."""
        day = day or dt.datetime.now(dt.UTC).date()
        async with self._sessions() as session, session.begin():
            dialect = session.bind.dialect.name if session.bind is not None else "sqlite"
            insert = pg_insert if dialect == "postgresql" else sqlite_insert
            statement = insert(UsageDaily).values(
                tenant_id=tenant_id,
                model=model,
                day=day,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                requests=1,
            )
            excluded = statement.excluded
            await session.execute(
                statement.on_conflict_do_update(
                    index_elements=["tenant_id", "model", "day"],
                    set_={
                        "prompt_tokens": UsageDaily.prompt_tokens + excluded.prompt_tokens,
                        "completion_tokens": UsageDaily.completion_tokens + excluded.completion_tokens,
                        "requests": UsageDaily.requests + 1,
                    },
                )
            )

    async def day_total(self, tenant_id: str, day: dt.date) -> int:
        """Prompt + completion tokens of a tenant on one UTC day, all models."""
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

    async def has_usage(self, tenant_id: str) -> bool:
        async with self._sessions() as session:
            found = await session.scalar(
                select(UsageDaily.id).where(UsageDaily.tenant_id == tenant_id).limit(1)
            )
        return found is not None
