"""Per-tenant queue gauges for Prometheus: requests waiting at the gateway and running on workers,
by tenant and class.

The dispatcher owns the queue; every `dispatch.heartbeat_interval_s` it lists what it holds and
`telemetry.set_tenant_queues` hands the (tenant label, class label) pairs here, the tenant labels
capped like every other per-tenant series (tenants past `gateway.metrics_max_tenants` share "other").
The collector answers a scrape from the latest counts, so a scrape never walks the queue. A tenant seen once
stays at 0 when its queue empties rather than vanishing, so `rate()`/`deriv()` in alert rules see a
continuous series. The per-class totals stay in `sluice:num_requests_waiting` / `_running`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

WAITING_NAME = "sluice:tenant_num_requests_waiting"
RUNNING_NAME = "sluice:tenant_num_requests_running"


class TenantQueueCollector(Collector):
    """The latest per-(tenant, class) counts, as two gauge families."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # scrapes run on the server's thread, publishes on the loop
        self._waiting: dict[tuple[str, str], int] = {}
        self._running: dict[tuple[str, str], int] = {}

    def publish(self, waiting: Iterable[tuple[str, str]], running: Iterable[tuple[str, str]]) -> None:
        """One (tenant label, class label) pair per request waiting and per request running."""
        new_waiting = Counter(waiting)
        new_running = Counter(running)
        with self._lock:
            self._waiting = {key: new_waiting.get(key, 0) for key in self._waiting.keys() | new_waiting.keys()}
            self._running = {key: new_running.get(key, 0) for key in self._running.keys() | new_running.keys()}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            waiting, running = dict(self._waiting), dict(self._running)
        for name, doc, counts in (
            (WAITING_NAME, "Requests queued at the gateway, per tenant and class.", waiting),
            (RUNNING_NAME, "Requests dispatched to workers and not finished, per tenant and class.", running),
        ):
            family = GaugeMetricFamily(name, doc, labels=("tenant", "class"))
            for (tenant, priority_class), value in sorted(counts.items()):
                family.add_metric((tenant, priority_class), value)
            yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Names only (the registry checks them for clashes without calling collect()).
        for name in (WAITING_NAME, RUNNING_NAME):
            yield GaugeMetricFamily(name, "", labels=("tenant", "class"))

