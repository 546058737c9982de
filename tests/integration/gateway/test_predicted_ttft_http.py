"""Predicted TTFT at admission over HTTP (gateway/dispatch/ttft.py, generation/service.py): a
request whose TTFT target no worker is predicted to meet is queued with its prediction in
`x-sluice-predicted-ttft-ms` (a tenant's `on_predicted_miss = "queue"`, the default), or refused at
once with a 429 saying why (`"shed"`), its quota hold released so the next request is admitted.
The real engine (demo model) fits its step-cost model from its own steps; the test first runs
enough steps for the model to be warm. Bad setting values are a 400 naming the field."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.integration

# A target no engine step meets (1 ms; the header may only tighten the tenant's 3 s).
IMPOSSIBLE = {"x-sluice-objective": "ttft=0.001"}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _warm_prediction(client: Any) -> float:
    """Runs engine steps until the worker's report carries a warm cost model; the predicted ms."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = client.post("/v1/chat/completions", json=_chat(max_tokens=24), headers=IMPOSSIBLE)
        assert answer.status_code == 200, answer.text
        predicted = answer.headers.get("x-sluice-predicted-ttft-ms")
        if predicted is not None:
            return float(predicted)
    raise AssertionError("the worker's cost model never became warm enough to predict")


def test_a_predicted_miss_is_queued_with_its_prediction_or_shed_with_a_429_that_frees_the_quota(gateway) -> None:
    tenant, key = gateway.tenant(priority_ceiling="interactive", default_class="interactive",
                                 quotas={"max_concurrent": 1})
    assert tenant["on_predicted_miss"] == "queue"
    with gateway.client(key) as client:
        predicted_ms = _warm_prediction(client)  # queued (200) although predicted to miss 1 ms
        assert predicted_ms >= 1
        loose = client.post("/v1/chat/completions", json=_chat())  # the class's 3 s: a prediction, met
        assert loose.status_code == 200 and "x-sluice-predicted-ttft-ms" in loose.headers
    with gateway.admin() as admin:
        changed = admin.patch(f"/admin/tenants/{tenant['id']}", json={"on_predicted_miss": "shed"})
        assert changed.status_code == 200 and changed.json()["on_predicted_miss"] == "shed", changed.text
    with gateway.client(key) as client:
        for stream in (False, True):
            shed = client.post("/v1/chat/completions", json=_chat(stream=stream), headers=IMPOSSIBLE)
            assert shed.status_code == 429, shed.text
            error = shed.json()["error"]
            assert error["code"] == "ttft_target_unattainable" and "time-to-first-token target" in error["message"]
            assert int(shed.headers["retry-after"]) >= 1 and int(shed.headers["x-sluice-predicted-ttft-ms"]) >= 1
            # Its concurrency slot (max_concurrent 1) was released: the next request is admitted at once.
            admitted = client.post("/v1/chat/completions", json=_chat(stream=stream))
            assert admitted.status_code == 200, admitted.text
        batch = client.post("/v1/chat/completions", json=_chat(service_tier="flex"), headers=IMPOSSIBLE)
        assert batch.status_code == 200  # batch has no TTFT target: never shed
        assert "x-sluice-predicted-ttft-ms" not in batch.headers


@pytest.mark.parametrize("bad", ["drop", "", "SHED", 1, None, ["shed"]])
def test_bad_on_predicted_miss_values_are_refused(gateway, bad: Any) -> None:
    tenant, _ = gateway.tenant()
    with gateway.admin() as admin:
        refused = admin.patch(f"/admin/tenants/{tenant['id']}", json={"on_predicted_miss": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "on_predicted_miss", refused.text
        created = admin.post("/admin/tenants", json={"name": f"x{abs(hash(str(bad))) % 10**6}",
                                                     "on_predicted_miss": bad})
        assert created.status_code == 400 and created.json()["error"]["param"] == "on_predicted_miss", created.text
