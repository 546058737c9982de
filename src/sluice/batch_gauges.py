"""The open batches' completion-window gauges, answered at scrape time from the latest measurement.

`sluice.gateway.batches.window.measure` reads the database every `ORPHAN_SWEEP_S` and publishes a
`WindowReport` here (`telemetry.BATCH_WINDOW`); this module has no database code, so the registry
(and `telemetry.metric_names()`) knows these names in every process:

- `sluice:batch_open` (batches validating or in progress), `sluice:batch_lines_remaining` (their
  lines without a result);
- `sluice:batch_window_left_seconds`: the least time left to any open batch's `expires_at`; no
  sample at all while no batch is open (a made-up "infinite" value would read as data).

Every replica reports the same database numbers, so rules aggregate them with `max`/`min`
(deploy/prometheus/alerts.yml: `SluiceBatchWindowAtRisk`). Nothing is published before the first
measurement, and nothing by a process without the Batch API.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class WindowReport:
    open_batches: int
    lines_remaining: int
    window_left_s: float | None  # None: no batch open



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
