"""Label values that cannot explode Prometheus's series count: tenants and workers past a cap share
the value "other" (the tenant cap is `gateway.metrics_max_tenants`, set by `telemetry.configure`),
and a class outside the three known ones is "other" too."""

from __future__ import annotations

import threading


class BoundedLabel:
    """Passes the first `limit` distinct values through, maps later ones to "other"."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def reset(self, limit: int) -> None:
        """A new cap and no value labelled yet (a process configures this once, at start)."""
        with self._lock:
            self.limit = limit
            self._seen.clear()

    def __call__(self, value: str) -> str:
        value = value or "unknown"
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
        return "other"


MAX_TENANT_LABELS = 100  # the default of gateway.metrics_max_tenants
MAX_WORKER_LABELS = 256
tenant_label = BoundedLabel(MAX_TENANT_LABELS)
worker_label = BoundedLabel(MAX_WORKER_LABELS)
_KNOWN_CLASSES = frozenset({"interactive", "standard", "batch"})


def class_label(value: str) -> str:
    return value if value in _KNOWN_CLASSES else "other"
