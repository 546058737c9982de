"""Per-tenant Prometheus series, scraped from `GET /metrics` over HTTP: TTFT and ITL histograms,
admissions and rejections by tenant and class, queue depth (waiting at the gateway, running on a
worker) by tenant and class, and the cap on tenant labels (`gateway.metrics_max_tenants`).

The engine runs one sequence at a time, so a few concurrent streams of one tenant leave some of
them queued at the gateway long enough for the dispatcher's once-a-second count to see them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CAP = 3  # the first two tests label three tenants at most; the last one goes past the cap


@pytest.fixture(scope="module")
def gateway_options() -> dict[str, Any]:
    return {"metrics_max_tenants": CAP}


@pytest.fixture(scope="module")
def engine_options() -> dict[str, Any]:
    return {"max_num_seqs": 1, "kv_cache_bytes": 32 * 2**20, "max_num_batched_tokens": 512}


def _scrape(gateway) -> tuple[str, dict[str, list[tuple[dict[str, str], float]]]]:
    """The /metrics text and its samples by name, through HTTP with the metrics token."""
    answer = httpx.get(gateway.base_url + "/metrics", headers={"authorization": f"Bearer {gateway.metrics_token}"})
    assert answer.status_code == 200
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return answer.text, samples


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(value for got, value in samples.get(name, []) if all(got.get(k) == v for k, v in labels.items()))


def test_queue_depth_per_tenant_shows_waiting_and_running_then_returns_to_zero(gateway) -> None:
    tenant, key = gateway.tenant()
    label = tenant["name"]  # the module's first tenant: within the cap
    body = {**CHAT, "max_tokens": 120, "ignore_eos": True, "stream": True}
    waiting = running = "sluice:tenant_num_requests_"
    seen_waiting = seen_running = 0.0

    def stream(_: int) -> int:
        with gateway.client(key) as client, client.stream("POST", "/v1/chat/completions", json=body) as answer:
            for _line in answer.iter_lines():
                pass
            return answer.status_code

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, i) for i in range(6)]
        while not all(f.done() for f in futures):
            _, samples = _scrape(gateway)
            seen_waiting = max(seen_waiting, _total(samples, waiting + "waiting", tenant=label))
            seen_running = max(seen_running, _total(samples, running + "running", tenant=label))
            time.sleep(0.2)
        assert [f.result() for f in futures] == [200] * 6
    assert seen_waiting >= 1, "no request of the tenant was ever seen waiting at the gateway"
    assert seen_running >= 1
    # Once all finished, the tenant's series stay, at zero (after the next count).
    for _ in range(100):
        _, samples = _scrape(gateway)
        names = {n for n in samples if n.startswith("sluice:tenant_num_requests_")}
        if names and all(_total(samples, n, tenant=label) == 0 for n in names):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the per-tenant queue gauges did not return to zero")
    assert any(labels["tenant"] == label for labels, _ in samples["sluice:tenant_num_requests_waiting"])


def test_latency_admissions_and_rejections_are_per_tenant_and_class(gateway) -> None:
    first, first_key = gateway.tenant()
    limited, limited_key = gateway.tenant(quotas={"requests_per_minute": 1})
    with gateway.client(first_key) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    with gateway.client(limited_key) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 429

    _, samples = _scrape(gateway)
    name = first["name"]
    ttft = [labels for labels, value in samples["sluice:time_to_first_token_seconds_count"]
            if labels["tenant"] == name and value == 1]
    assert len(ttft) == 1 and ttft[0]["model"] == "demo" and ttft[0]["class"] in ("interactive", "standard")
    klass = ttft[0]["class"]
    assert _total(samples, "sluice:inter_token_latency_seconds_count", tenant=name, **{"class": klass}) == 3
    assert _total(samples, "sluice:request_admissions_total", tenant=name, **{"class": klass}) == 1
    assert _total(samples, "sluice:request_admissions_total", tenant=limited["name"]) == 1
    rejected = [labels for labels, value in samples["sluice:request_rejections_total"]
                if labels["tenant"] == limited["name"] and value == 1]
    assert len(rejected) == 1 and rejected[0]["class"] == klass


def test_tenants_past_the_cap_are_counted_under_other_without_their_names(gateway) -> None:
    _, before = _scrape(gateway)
    tenants = [gateway.tenant() for _ in range(CAP + 1)]  # the last one is past the cap, whatever ran before
    for _, key in tenants:
        with gateway.client(key) as client:
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    text, samples = _scrape(gateway)
    assert tenants[-1][0]["name"] not in text
    assert _total(samples, "sluice:request_admissions_total", tenant="other") >= 1
    assert _total(samples, "sluice:time_to_first_token_seconds_count", tenant="other") >= 1
    assert _total(samples, "sluice:inter_token_latency_seconds_count", tenant="other") >= 3
    # series of this process's earlier tests stay in the registry: look only at the ones this test added
    added = ({labels["tenant"] for labels, _ in samples["sluice:request_admissions_total"]}
             - {labels["tenant"] for labels, _ in before.get("sluice:request_admissions_total", [])})
    assert added <= {tenant["name"] for tenant, _ in tenants[:-1]} | {"other"}


def test_alert_inputs_readiness_workers_and_error_answers_are_exported(gateway) -> None:
    """What deploy/prometheus/alerts.yml reads besides latency: /ready's checks, the workers a
    gateway can reach, error answers by status."""
    _, before = _scrape(gateway)
    _, key = gateway.tenant()
    with gateway.client(key) as client:
        assert client.get("/v1/no-such-route").status_code == 404
        assert client.post("/v1/chat/completions", json={"model": "demo"}).status_code == 400
    _, samples = _scrape(gateway)
    for status in ("404", "400"):
        grew = _total(samples, "sluice:http_error_responses_total", status=status) - _total(
            before, "sluice:http_error_responses_total", status=status)
        assert grew == 1, status
    checks = {labels["check"]: value for labels, value in samples["sluice:readiness_check"]}
    assert checks == {"accepting": 1, "database": 1, "workers": 1}  # in-process state: no "shared" check
    assert _total(samples, "sluice:workers_connected") >= 1
