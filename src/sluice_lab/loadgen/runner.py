"""Replays a scenario against a server: arrival processes, closed loops, bursts, batch jobs.

Open-loop arrivals (Poisson, gamma, bursts) are drawn up front from the seed, so two runs with
the same seed send the same requests at the same offsets whatever the server does; closed-loop
workloads issue their next request when the previous one finishes (plus think time).
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from sluice_lab.loadgen.batch import BatchOutcome, run_batch_workload
from sluice_lab.loadgen.client import ClientResult, RequestSpec, send_streaming
from sluice_lab.loadgen.prompts import PromptFactory
from sluice_lab.loadgen.scenario import Scenario, Workload

# httpx logs every request at INFO; at hundreds of requests per second that drowns the report.
logging.getLogger("httpx").setLevel(logging.WARNING)


@dataclass(slots=True)
class RunResult:
    results: list[ClientResult]
    batches: list[BatchOutcome]
    started: float
    wall_s: float
    base_url: str
    extra: dict[str, object] = field(default_factory=dict)


def arrival_offsets(workload: Workload, duration_s: float, rng: random.Random) -> list[float]:
    """Open-loop send times (seconds from start) of one workload within `duration_s`."""
    arrival = workload.arrival
    times: list[float] = []
    if arrival.process in ("poisson", "gamma"):
        # gamma with shape k = 1/cv^2 and mean 1/rate: cv = 1 is Poisson, cv > 1 is burstier.
        shape = 1.0 / (arrival.cv**2)
        scale = 1.0 / (arrival.rate * shape)
        t = 0.0
        while True:
            t += rng.expovariate(arrival.rate) if arrival.process == "poisson" else rng.gammavariate(
                shape, scale)
            if t >= duration_s:
                break
            times.append(t)
    for burst in workload.bursts:
        if burst.at_s < duration_s:
            times.extend([burst.at_s] * burst.count)
    return sorted(times)


class _SpecMaker:
    def __init__(self, scenario: Scenario, seed: int) -> None:
        self.scenario = scenario
        self.prompts = PromptFactory(scenario.tokenizer or None)
        self.rngs = {w.name: random.Random(f"{seed}:{w.name}") for w in scenario.workloads}
        self.count = 0

    def make(self, workload: Workload) -> RequestSpec:
        rng = self.rngs[workload.name]
        self.count += 1
        return RequestSpec(
            local_id=f"{workload.name}-{self.count}", workload=workload.name,
            tenant=workload.tenant.name, api_key=workload.tenant.api_key,
            prompt=self.prompts.make(workload.prompt_tokens.sample(rng), rng),
            max_tokens=workload.output_tokens.sample(rng), service_tier=workload.service_tier,
            ignore_eos=workload.ignore_eos, temperature=workload.temperature)


async def run_scenario(scenario: Scenario, base_url: str, *, seed: int | None = None,
                       duration_s: float | None = None, max_requests: int | None = None,
                       request_timeout_s: float = 600.0, progress: bool | None = None,
                       reconnects: int = 0) -> RunResult:
    seed = scenario.seed if seed is None else seed
    duration = scenario.duration_s if duration_s is None else duration_s
    cap = scenario.max_requests if max_requests is None else max_requests
    maker = _SpecMaker(scenario, seed)
    open_loop: list[tuple[float, RequestSpec]] = []
    for workload in scenario.workloads:
        if workload.api == "stream":  # closed-loop workloads contribute their bursts only
            rng = random.Random(f"{seed}:{workload.name}:arrivals")
            open_loop.extend((t, maker.make(workload)) for t in arrival_offsets(workload, duration, rng))
    open_loop.sort(key=lambda item: item[0])
    if cap:
        open_loop = open_loop[:cap]
    results: list[ClientResult] = []
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=len(open_loop) or None, desc=scenario.name, unit="req", disable=not show)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    started = time.time()
    issued = {"n": len(open_loop)}

    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, limits=limits) as client:

        async def one(spec: RequestSpec) -> None:
            result = await send_streaming(client, spec, model=scenario.model, endpoint=scenario.endpoint,
                                          reconnects=reconnects)
            results.append(result)
            bar.update(1)

        async def open_sender(offset: float, spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, started + offset - time.time()))
            await one(spec)

        async def closed_user(workload: Workload) -> None:
            while time.time() - started < duration and (not cap or issued["n"] < cap):
                issued["n"] += 1
                await one(maker.make(workload))
                if workload.arrival.think_s:
                    await asyncio.sleep(workload.arrival.think_s)

        tasks = [open_sender(t, spec) for t, spec in open_loop]
        for workload in scenario.workloads:
            if workload.api == "stream" and workload.arrival.process == "closed":
                tasks.extend(closed_user(workload) for _ in range(workload.arrival.concurrency))
        batch_tasks = [run_batch_workload(client, workload, maker.make, model=scenario.model,
                                          endpoint=scenario.endpoint, timeout_s=max(duration, 1.0) * 20)
                       for workload in scenario.workloads if workload.api == "batch"]
        gathered = await asyncio.gather(asyncio.gather(*tasks), asyncio.gather(*batch_tasks))
    bar.close()
    batches: list[BatchOutcome] = list(gathered[1])
    return RunResult(results=results, batches=batches, started=started, wall_s=time.time() - started,
                     base_url=base_url)
