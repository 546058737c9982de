"""`sluice bench isolation`: does a batch flood hurt interactive tenants?

Two stacks (`sluice serve`): priority scheduling on (the default) and off
(SLUICE_SCHEDULER_PRIORITY_ENABLED=false: every class shares one lane). In each, an interactive
tenant sends the same seeded Poisson load twice: once on an idle stack (baseline), then again
while a batch tenant's translation flood (`--flood` lines through /v1/files + /v1/batches) is
queued and running. Headline: the interactive tenant's TTFT p95 with the flood over without it,
per arm; the product target is <= 1.5 with priority on.

The flood is cancelled once the interactive run is over (it only needs to be queued and
running while the interactive requests arrive), then the stack stops.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sluice.errors import CLIError
from sluice.telemetry import percentile
from sluice_lab.experiments.common import ratio, resolve_model
from sluice_lab.experiments.stack import Stack, start_stack
from sluice_lab.loadgen.batch import batch_jsonl
from sluice_lab.loadgen.client import ClientResult, RequestSpec
from sluice_lab.loadgen.prompts import LengthDist, PromptFactory
from sluice_lab.loadgen.runner import run_scenario
from sluice_lab.loadgen.scenario import Arrival, Scenario, Slo, Tenant, Workload


@dataclass(frozen=True, slots=True)
class IsolationLoad:
    flood: int = 2000
    interactive_requests: int = 30
    interactive_rate: float = 1.5  # requests/s
    interactive_prompt: int = 64
    interactive_output: int = 16
    flood_prompt: int = 64
    flood_output: int = 32
    settle_s: float = 3.0  # flood running before the interactive requests start


def _interactive_scenario(model: str, key: str, load: IsolationLoad, seed: int) -> Scenario:
    workload = Workload(
        name="interactive", tenant=Tenant("bench-interactive", key),
        arrival=Arrival("poisson", rate=load.interactive_rate),
        prompt_tokens=LengthDist("fixed", value=load.interactive_prompt),
        output_tokens=LengthDist("fixed", value=load.interactive_output), service_tier="priority")
    return Scenario(name="interactive", model=model, endpoint="chat", workloads=(workload,), slo=Slo(),
                    duration_s=3600.0, max_requests=load.interactive_requests, seed=seed)


def _ttft_summary(results: list[ClientResult]) -> dict[str, Any]:
    ttfts = [r.first_token - r.sent for r in results if r.ok and r.first_token is not None]
    return {"requests": len(results), "errors": sum(1 for r in results if not r.ok),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
            "ttft_p99_s": percentile(ttfts, 99), "ttfts_s": ttfts}


def _submit_flood(stack: Stack, key: str, load: IsolationLoad, tokenizer_dir: Path) -> str:
    import random

    rng = random.Random(1)
    prompts = PromptFactory(str(tokenizer_dir))
    specs = [RequestSpec(local_id=f"flood-{i}", workload="flood", tenant="bench-batch", api_key=key,
                         prompt=prompts.make(load.flood_prompt, rng), max_tokens=load.flood_output,
                         service_tier="flex", ignore_eos=True, temperature=0.0) for i in range(load.flood)]
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=stack.base_url, headers=headers, timeout=300) as client:
        upload = client.post("/v1/files", data={"purpose": "batch"},
                             files={"file": ("flood.jsonl", batch_jsonl(specs, stack.model, "chat"),
                                             "application/jsonl")})
        if upload.status_code != 200:
            raise CLIError(f"flood upload failed ({upload.status_code}): {upload.text[:300]}")
        created = client.post("/v1/batches", json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})
        if created.status_code != 200:
            raise CLIError(f"flood batch creation failed ({created.status_code}): {created.text[:300]}")
        return str(created.json()["id"])


def _batch_status(stack: Stack, key: str, batch_id: str, cancel: bool = False) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    path = f"/v1/batches/{batch_id}" + ("/cancel" if cancel else "")
    method = "POST" if cancel else "GET"
    response = httpx.request(method, stack.base_url + path, headers=headers, timeout=60)
    return response.json() if response.status_code == 200 else {"error": response.text[:300]}


def run_arm(priority: bool, model_dir: Path, config_dir: str, load: IsolationLoad, seed: int,
            workdir: Path) -> dict[str, Any]:
    env = {"SLUICE_SCHEDULER_PRIORITY_ENABLED": "true" if priority else "false"}
    with start_stack(config_dir, workdir, model_dir, env=env) as stack:
        interactive_key = stack.create_tenant_key("bench-interactive", ceiling="interactive",
                                                  default_class="interactive")
        batch_key = stack.create_tenant_key("bench-batch", ceiling="batch", default_class="batch")
        scenario = _interactive_scenario(stack.model, interactive_key, load, seed)
        # Warm-up: the first requests pay for lazy imports, Kafka metadata and first-shape costs.
        warm_up = dataclasses.replace(scenario, max_requests=max(3, load.interactive_requests // 3))
        asyncio.run(run_scenario(warm_up, stack.base_url, progress=False))
        baseline = asyncio.run(run_scenario(scenario, stack.base_url, progress=False))
        submitted = time.time()
        batch_id = _submit_flood(stack, batch_key, load, model_dir)
        accepted_s = time.time() - submitted
        time.sleep(load.settle_s)
        flooded = asyncio.run(run_scenario(scenario, stack.base_url, progress=False))
        status = _batch_status(stack, batch_key, batch_id)
        _batch_status(stack, batch_key, batch_id, cancel=True)
    counts = status.get("request_counts") or {}
    return {"priority": priority, "baseline": _ttft_summary(baseline.results),
            "flood": _ttft_summary(flooded.results),
            "flood_batch": {"lines": load.flood, "accepted_in_s": accepted_s,
                            "completed_during_run": counts.get("completed"), "status": status.get("status")}}


def run_isolation(model_dir: Path, config_dir: str, load: IsolationLoad, seed: int,
                  workdir: Path) -> dict[str, Any]:
    arms = {}
    for name, priority in (("priority_on", True), ("priority_off", False)):
        arms[name] = run_arm(priority, model_dir, config_dir, load, seed, workdir / name)
    ratios = {name: ratio(arm["flood"]["ttft_p95_s"], arm["baseline"]["ttft_p95_s"])
              for name, arm in arms.items()}
    return {
        "interactive_ttft_p95_ratio_flood_over_baseline": ratios,
        "target": {"priority_on_ratio_max": 1.5},
        "meets_target": bool(ratios["priority_on"] is not None and ratios["priority_on"] <= 1.5),
        "load": {**{k: getattr(load, k) for k in IsolationLoad.__dataclass_fields__}, "seed": seed,
                 "model": str(model_dir)},
        "arms": arms,
    }


def plot_isolation(summary: dict[str, Any], path: str | Path) -> None:
    from sluice_lab.experiments.plots import new_figure, save

    fig, (cdf, bars) = new_figure(1, 2, figsize=(12, 4.8))
    for arm_name, arm in summary["arms"].items():
        for phase in ("baseline", "flood"):
            values = sorted(arm[phase]["ttfts_s"])
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                cdf.plot(values, fractions, label=f"{arm_name} {phase}")
    cdf.set(xscale="log", xlabel="interactive TTFT (s)", ylabel="fraction of requests",
            title="Interactive TTFT with and without a batch flood")
    cdf.legend(fontsize=8)
    names = list(summary["arms"])
    ratios = [summary["interactive_ttft_p95_ratio_flood_over_baseline"][n] or 0.0 for n in names]
    bars.bar(names, ratios, color=["tab:green", "tab:red"][: len(names)])
    bars.axhline(1.5, color="grey", linestyle="--", linewidth=1)
    bars.set(ylabel="TTFT p95 flood / baseline", title=f"flood of {summary['load']['flood']} batch lines "
                                                         "(dashed: target 1.5)")
    save(fig, path)


def run_isolation_command(args: argparse.Namespace) -> int:
    from sluice_lab.cli import write_json

    if args.flood < 1:
        raise CLIError("--flood must be positive")
    load = IsolationLoad(flood=args.flood)
    if args.quick:
        load = IsolationLoad(flood=min(args.flood, 40), interactive_requests=6, interactive_rate=3.0,
                             interactive_output=4, flood_output=8, settle_s=1.0)
    if args.interactive_requests is not None:
        if args.interactive_requests < 1:
            raise CLIError("--interactive-requests must be positive")
        load = dataclasses.replace(load, interactive_requests=args.interactive_requests)
    with tempfile.TemporaryDirectory(prefix="sluice-isolation-") as tmp:
        summary = run_isolation(resolve_model(args.model), args.config_dir, load, args.seed, Path(tmp))
    write_json(args.json_out, summary)
    plot_isolation(summary, args.plot)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    for name, arm in summary["arms"].items():
        print(f"{name}: interactive TTFT p95 {ms(arm['baseline']['ttft_p95_s'])} without the flood, "
              f"{ms(arm['flood']['ttft_p95_s'])} with it (ratio "
              f"{summary['interactive_ttft_p95_ratio_flood_over_baseline'][name]}); errors "
              f"{arm['baseline']['errors']}+{arm['flood']['errors']}")
    print(f"wrote {args.json_out} and {args.plot}")
    return 0
