"""The Grafana dashboard only queries metrics that sluice's telemetry registry exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sluice import telemetry

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parents[3] / "docker" / "grafana-dashboard.json"
METRIC = re.compile(r"\bsluice:[a-zA-Z_:][a-zA-Z0-9_:]*")


def _expressions(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        return found + [e for v in node.values() for e in _expressions(v)]
    if isinstance(node, list):
        return [e for v in node for e in _expressions(v)]
    return []


def test_every_dashboard_metric_exists_in_the_registry() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = _expressions(dashboard)
    assert len(exprs) >= 10
    used = {m for e in exprs for m in METRIC.findall(e)}
    missing = used - telemetry.metric_names()
    assert not missing, f"dashboard queries unknown metrics: {sorted(missing)}"


def test_dashboard_shows_latency_quantiles_by_class_queue_throughput_and_kv() -> None:
    text = DASHBOARD.read_text(encoding="utf-8")
    for q in ("0.5", "0.95", "0.99"):
        for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
            assert f"histogram_quantile({q}, sum by (le, class) (rate(sluice:{metric}_bucket" in text
    for name in ("sluice:num_requests_waiting", "sluice:generation_tokens_total",
                 "sluice:kv_cache_usage_perc"):
        assert name in text


def test_dashboard_shows_the_per_tenant_series_and_the_alert_inputs() -> None:
    text = DASHBOARD.read_text(encoding="utf-8")
    for name in ("sluice:tenant_num_requests_waiting", "sluice:request_admissions_total",
                 "sluice:request_rejections_total", "sluice:workers_connected", "sluice:readiness_check"):
        assert name in text
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        assert f"sum by (le, tenant, class) (rate(sluice:{metric}_bucket" in text
