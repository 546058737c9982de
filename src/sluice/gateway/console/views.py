"""What the console's live fragments show, as plain records built from the live sources.

Sources: `backend.snapshot()` (gateway/queueing/snapshot.py: queues, running jobs, workers), the rolling
telemetry window (`sluice.live_window.WINDOW`: rates, latency series, objectives' outcomes, recent events) and the
tenant list (for names: the scheduler knows tenants by id, telemetry by name).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sluice.gateway.console.charts import Sparkline, sparkline
from sluice.live_window import LiveWindow, SloSummary
from sluice.protocol import Priority


@dataclass(frozen=True, slots=True)
class ClassRow:
    label: str
    depth: int
    oldest_wait_s: float | None
    running: int
    admitted_per_min: int
    rejected_per_min: int


@dataclass(frozen=True, slots=True)
class TenantQueueRow:
    name: str
    depth: dict[str, int]  # class label -> queued
    total: int
    running: int
    oldest_wait_s: float | None
    admitted_per_min: int
    rejected_per_min: int


@dataclass(frozen=True, slots=True)
class WorkerRow:
    worker_id: str
    models: str
    device: str
    running: int
    waiting: int
    kv_used: int
    kv_total: int
    kv_percent: int
    kv_known: bool  # False for an upstream server: it reports no KV blocks (shown as "n/a", not "0 / 0")
    tokens_per_s: float
    heartbeat_age_s: float | None
    state: str  # serving | draining | drained
    inflight: int
    # Prompt tokens it found in its prefix cache / all it was sent (None: none finished yet), the
    # tokens that saved, and the blocks the gateway's routing index holds for it (docs/routing.md).
    cache_hit_percent: int | None = None
    prefill_saved: int = 0
    cache_index_blocks: int = 0


@dataclass(frozen=True, slots=True)
class TenantCharts:
    name: str
    ttft: Sparkline
    itl: Sparkline
    throughput: Sparkline


def queue_rows(snapshot: dict[str, Any], names: dict[str, str],
               window: LiveWindow) -> tuple[list[ClassRow], list[TenantQueueRow]]:
    """Per class and per tenant: depth, oldest wait, running, admitted/rejected in the last minute."""
    queues = snapshot.get("queues", {})
    classes: dict[str, Any] = queues.get("classes", {})
    running: dict[str, int] = queues.get("running", {})
    now = time.time()
    class_rows = [
        ClassRow(
            label=p.label,
            depth=int(classes.get(p.label, {}).get("depth", 0)),
            oldest_wait_s=classes.get(p.label, {}).get("oldest_wait_s"),
            running=int(running.get(p.label, 0)),
            admitted_per_min=window.per_minute("admitted_class", p.label, now),
            rejected_per_min=window.per_minute("rejected_class", p.label, now),
        )
        for p in Priority
    ]
    depth: dict[str, dict[str, int]] = {}
    oldest: dict[str, float] = {}
    for label, info in classes.items():
        for tenant_id, n in info.get("tenants", {}).items():
            depth.setdefault(names.get(tenant_id, tenant_id), {})[label] = n
        for tenant_id, wait in info.get("tenant_oldest_wait_s", {}).items():
            name = names.get(tenant_id, tenant_id)
            oldest[name] = max(oldest.get(name, 0.0), wait)
    running_by = {names.get(t, t): n for t, n in queues.get("running_tenants", {}).items()}
    active = set(depth) | set(running_by) | set(window.tenants(now))
    tenant_rows = [
        TenantQueueRow(
            name=name,
            depth=depth.get(name, {}),
            total=sum(depth.get(name, {}).values()),
            running=running_by.get(name, 0),
            oldest_wait_s=oldest.get(name),
            admitted_per_min=window.per_minute("admitted", name, now),
            rejected_per_min=window.per_minute("rejected", name, now),
        )
        for name in active
    ]
    tenant_rows.sort(key=lambda r: (-r.total, -r.running, -r.admitted_per_min, r.name))
    return class_rows, tenant_rows


def worker_rows(snapshot: dict[str, Any], window: LiveWindow) -> list[WorkerRow]:
    rows = []
    for w in snapshot.get("workers", []):
        total = int(w.get("total_kv_blocks", 0))
        used = total - int(w.get("free_kv_blocks", 0))
        inflight = int(w.get("inflight", w.get("num_running", 0)))
        draining = bool(w.get("draining", False))
        rows.append(WorkerRow(
            worker_id=str(w["worker_id"]),
            models=", ".join(w.get("models", [])),
            device=str(w.get("device", "in-process")),
            running=int(w.get("num_running", 0)),
            waiting=int(w.get("num_waiting", 0)),
            kv_used=used,
            kv_total=total,
            kv_percent=round(100 * used / total) if total else 0,
            kv_known=w.get("kind") != "upstream",
            tokens_per_s=window.tokens_per_s(str(w["worker_id"])),
            heartbeat_age_s=w.get("last_heartbeat_age_s"),
            state=("drained" if inflight == 0 else "draining") if draining else "serving",
            inflight=inflight,
            cache_hit_percent=(None if w.get("cache_hit_rate") is None else round(100 * float(w["cache_hit_rate"]))),
            prefill_saved=int(w.get("cached_prompt_tokens", 0)),
            cache_index_blocks=int(w.get("cache_index_blocks", 0)),
        ))
    return sorted(rows, key=lambda r: r.worker_id)


def tenant_charts(window: LiveWindow, limit: int = 60) -> list[TenantCharts]:
    """TTFT p95, ITL p95 and tokens/s per time bucket, for each tenant active in the window."""
    now = time.time()
    charts = []
    for name in window.tenants(now)[:limit]:
        points = window.series(name, now)
        if not any(p.tokens_per_s or p.ttft_p95_s is not None for p in points):
            continue  # only rejected in the window: nothing to draw
        charts.append(TenantCharts(
            name=name,
            ttft=sparkline([p.ttft_p95_s for p in points]),
            itl=sparkline([p.itl_p95_s for p in points]),
            throughput=sparkline([p.tokens_per_s for p in points[:-1]]),  # the partial bucket would dip
        ))
    return charts


@dataclass(frozen=True, slots=True)
class SloRow:
    """One (class, tenant) against its latency objective over the window (docs/objectives.md)."""

    priority_class: str
    tenant: str
    requests: int
    attained_percent: int  # requests that met both targets / requests judged
    goodput_per_min: float  # requests that met both targets, per minute over the window
    ttft_target_s: float | None
    ttft_p95_s: float | None
    ttft_missed: bool  # the p95 is over the target
    itl_target_s: float | None
    itl_p95_s: float | None
    itl_missed: bool


def slo_rows(window: LiveWindow) -> list[SloRow]:
    """Per class and tenant with requests judged in the window: the objective, the share that met it,
    goodput, and TTFT / ITL p95 beside their targets."""

    def over(value: float | None, target: float | None) -> bool:
        return value is not None and target is not None and value > target

    def row(s: SloSummary) -> SloRow:
        return SloRow(
            priority_class=s.priority_class, tenant=s.tenant, requests=s.requests,
            attained_percent=int(100 * s.attained),  # floor: 99.6 % met is not shown as 100
            goodput_per_min=s.met * 60.0 / window.horizon_s,
            ttft_target_s=s.ttft_target_s, ttft_p95_s=s.ttft_p95_s, ttft_missed=over(s.ttft_p95_s, s.ttft_target_s),
            itl_target_s=s.itl_target_s, itl_p95_s=s.itl_p95_s, itl_missed=over(s.itl_p95_s, s.itl_target_s),
        )

    order = {p.label: p.value for p in Priority}
    rows = [row(s) for s in window.slo_summaries()]
    return sorted(rows, key=lambda r: (order.get(r.priority_class, len(order)), r.tenant))
