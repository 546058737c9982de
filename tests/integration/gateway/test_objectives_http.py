"""Latency objectives over HTTP (sluice/objectives.py): a tenant's targets through the admin API,
the request header that can only tighten them, and garbage refused with a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.integration


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def test_tenant_targets_and_the_header_shape_what_a_request_is_served_against(gateway) -> None:
    tenant, key = gateway.tenant(priority_ceiling="interactive", default_class="interactive")
    assert tenant["ttft_target_s"] is None and tenant["itl_target_s"] is None  # the class's
    with gateway.client(key) as client:
        answer = client.post("/v1/chat/completions", json=_chat())
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sluice-objective"] == "ttft=3, itl=0.3"  # [objectives] interactive
        tighter = client.post("/v1/chat/completions", json=_chat(), headers={"x-sluice-objective": "itl=0.1, ttft=9"})
        assert tighter.headers["x-sluice-objective"] == "ttft=3, itl=0.1"  # a looser ttft is not taken
        batch = client.post("/v1/chat/completions", json=_chat(service_tier="flex"),
                            headers={"x-sluice-objective": "itl=0.1"})
        assert batch.status_code == 200 and batch.headers["x-sluice-objective"] == "none"
    with gateway.admin() as admin:
        changed = admin.patch(f"/admin/tenants/{tenant['id']}", json={"ttft_target_s": 1.5, "itl_target_s": 0.25})
        assert changed.status_code == 200, changed.text
        assert (changed.json()["ttft_target_s"], changed.json()["itl_target_s"]) == (1.5, 0.25)
        assert admin.get(f"/admin/tenants/{tenant['id']}").json()["itl_target_s"] == 0.25
    with gateway.client(key) as client:
        answer = client.post("/v1/chat/completions", json=_chat(stream=True))
        assert answer.status_code == 200 and answer.headers["x-sluice-objective"] == "ttft=1.5, itl=0.25"


@pytest.mark.parametrize("bad", [0, -1, 3601, "soon", True, [1]])
def test_bad_tenant_targets_are_refused(gateway, bad: Any) -> None:
    tenant, _ = gateway.tenant()
    with gateway.admin() as admin:
        for field in ("ttft_target_s", "itl_target_s"):
            refused = admin.patch(f"/admin/tenants/{tenant['id']}", json={field: bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
            created = admin.post("/admin/tenants", json={"name": f"x{abs(hash(str(bad))) % 10**6}", field: bad})
            assert created.status_code == 400 and created.json()["error"]["param"] == field, created.text


@pytest.mark.parametrize("bad", ["fast", "itl=0", "ttft=-2", "itl=nan", "ttft=1,ttft=1", "itl=1e9", "ttft=1;itl=1"])
def test_a_garbage_objective_header_is_a_400_naming_it(gateway, bad: str) -> None:
    _, key = gateway.tenant()
    with gateway.client(key) as client:
        refused = client.post("/v1/chat/completions", json=_chat(), headers={"x-sluice-objective": bad})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "X-Sluice-Objective" and error["type"] == "invalid_request_error"


def test_the_console_form_edits_a_tenant_s_targets() -> None:
    from sluice.gateway.console.forms import tenant_patch
    from sluice.gateway.edge.errors import OpenAIError

    form = {"weight": "1", "priority_ceiling": "standard", "default_class": "standard"}
    patch = tenant_patch({**form, "ttft_target_s": "2.5", "itl_target_s": ""})
    assert patch.ttft_target_s == 2.5 and patch.itl_target_s is None
    assert tenant_patch({**form, "on_predicted_miss": "shed"}).on_predicted_miss == "shed"
    with pytest.raises(OpenAIError) as exc:
        tenant_patch({**form, "on_predicted_miss": "drop"})
    assert exc.value.param == "on_predicted_miss"
    with pytest.raises(OpenAIError) as exc:
        tenant_patch({**form, "itl_target_s": "quick"})
    assert exc.value.param == "itl_target_s"


def test_the_load_generator_judges_each_request_by_the_objective_it_was_served_against(gateway) -> None:
    """`sluice bench serve`'s client reads X-Sluice-Objective off the real answer, and its report
    judges interactive against the tenant's targets and leaves batch (no objective) unjudged."""
    import asyncio

    import httpx

    from sluice_lab.loadgen.client import RequestSpec, send_streaming
    from sluice_lab.loadgen.report import summarize
    from sluice_lab.loadgen.scenario import Slo

    _, key = gateway.tenant(priority_ceiling="interactive", default_class="interactive", ttft_target_s=60.0,
                            itl_target_s=30.0)

    async def send(tier: str | None) -> Any:
        spec = RequestSpec(local_id=str(tier), workload="w", tenant="t", api_key=key, prompt="hi", max_tokens=3,
                           service_tier=tier, ignore_eos=True, temperature=0.0)
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
            return await send_streaming(client, spec, model="demo", endpoint="chat")

    interactive, batch = asyncio.run(send(None)), asyncio.run(send("flex"))
    assert interactive.ok and batch.ok, (interactive.error_detail, batch.error_detail)
    assert (interactive.objective.ttft_s, interactive.objective.itl_s) == (60.0, 30.0)
    assert (batch.objective.ttft_s, batch.objective.itl_s) == (None, None)
    summary = summarize([interactive, batch], wall_s=1.0, slo=Slo(ttft_s=1e-6, itl_s=1e-6))  # the SLO is not used
    assert summary["judged"] == 1 and summary["slo_attainment"] == 1.0
    assert (summary["ttft_target_s"], summary["itl_target_s"]) == (60.0, 30.0)
