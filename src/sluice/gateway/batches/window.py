"""How close the open batches are to their completion window, for Prometheus and its alert rules.

Every `ORPHAN_SWEEP_S` the batch sweeper asks the database (`measure`) for the batches still
running (`validating` / `in_progress`): how many, how many of their lines have no result yet, and
the time left before the earliest of their windows closes. `BatchWindowCollector` answers scrapes
from the latest answer:

- `sluice:batch_open` (batches), `sluice:batch_lines_remaining` (lines without a result);
- `sluice:batch_window_left_seconds`: the least time left to any open batch's `expires_at`; no
  sample at all while no batch is open (a made-up "infinite" value would read as data).

Every replica reports the same database numbers, so rules aggregate them with `max`/`min`
(deploy/prometheus/alerts.yml: `BatchWindowAtRisk`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from sluice import telemetry
from sluice.gateway.batches.models import Batch, BatchResult
from sluice.gateway.batches.service import RUNNABLE
from sluice.gateway.db.base import utcnow


@dataclass(frozen=True, slots=True)
class WindowReport:
    open_batches: int
    lines_remaining: int
    window_left_s: float | None  # None: no batch open


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


class BatchWindowCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()  # published on the event loop, read by the scrape
        self._report: WindowReport | None = None  # None: not measured yet (no samples)

    def publish(self, report: WindowReport) -> None:
        with self._lock:
            self._report = report

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            report = self._report
        families = self.describe()
        if report is None:
            yield from families
            return
        opened, remaining, left = families
        opened.add_metric((), report.open_batches)
        remaining.add_metric((), report.lines_remaining)
        if report.window_left_s is not None:
            left.add_metric((), report.window_left_s)
        yield from (opened, remaining, left)

    def describe(self) -> list[GaugeMetricFamily]:  # type: ignore[override]
        return [
            GaugeMetricFamily("sluice:batch_open", "Batches validating or in progress."),
            GaugeMetricFamily("sluice:batch_lines_remaining", "Lines of the open batches without a result yet."),
            GaugeMetricFamily("sluice:batch_window_left_seconds",
                              "Seconds until the earliest completion window of an open batch closes "
                              "(no sample while none is open)."),
        ]


BATCH_WINDOW = BatchWindowCollector()
telemetry.REGISTRY.register(BATCH_WINDOW)
