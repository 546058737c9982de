"""How close the open batches are to their completion window, for Prometheus and its alert rules.

Every `ORPHAN_SWEEP_S` the batch sweeper asks the database (`measure`) for the batches still
running (`validating` / `in_progress`): how many, how many of their lines have no result yet, and
the time left before the earliest of their windows closes; it publishes that to
`telemetry.BATCH_WINDOW` (sluice/batch_gauges.py says what the gauges mean).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from sluice.batch_gauges import WindowReport
from sluice.gateway.batches.models import Batch, BatchResult
from sluice.gateway.batches.service import RUNNABLE
from sluice.gateway.db.base import utcnow


async def measure(sessions: Any) -> WindowReport:
    """The open batches' numbers, from the database (two aggregate queries)."""
    async with sessions() as session:
        count, lines, earliest = (await session.execute(
            select(func.count(Batch.id), func.coalesce(func.sum(Batch.total), 0), func.min(Batch.expires_at))
            .where(Batch.status.in_(RUNNABLE)))).one()
        done = 0
        if count:
            done = (await session.execute(
                select(func.count(BatchResult.id)).join(Batch, Batch.id == BatchResult.batch_id)
                .where(Batch.status.in_(RUNNABLE)))).scalar_one()
    left = None if earliest is None else (earliest - utcnow()).total_seconds()
    return WindowReport(int(count), max(0, int(lines) - int(done)), left)
