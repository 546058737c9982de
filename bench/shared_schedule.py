"""What the global schedule adds to a dispatch: the worker-slot take (and its release) and the
fairness sync, in Redis, against the in-process decision, measured side by side in one run.

`--replicas` dispatch loops run at once, each with its own client (as gateway replicas do); each
loop takes its slots one after another, as a replica's dispatch loop does, over `--workers`
candidate workers. A take is `RedisSlots.take` (one TAKE_SLOT script); its release is awaited
before the next take, so the counts stay low and every take is granted. The in-process arm is
`LocalSlots.take` on the same candidates. Prints p50/p99 in microseconds and can write JSON.

    PYTHONPATH=. python bench/shared_schedule.py --redis-url redis://127.0.0.1:6379/0 --takes 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import cast

from redis.asyncio import Redis

from sluice.gateway.dispatch.dispatcher import Job
from sluice.gateway.dispatch.fair import ClassPolicy, FairScheduler, Pending
from sluice.gateway.dispatch.fair_shared import RedisFairness
from sluice.gateway.dispatch.links.tcp import WorkerConn
from sluice.gateway.dispatch.slots import LocalSlots, RedisSlots
from sluice.gateway.generation.state import RequestState
from sluice.protocol import GenerateRequest, Priority, SamplingParams, ServedModelInfo, WorkerCapacity, WorkerRegister
from sluice.telemetry import percentile


def _worker(worker_id: str) -> WorkerConn:
    capacity = WorkerCapacity(worker_id=worker_id, num_running=0, num_waiting=0, free_kv_blocks=1,
                              total_kv_blocks=1, max_num_seqs=1, sent_at=time.time())
    register = WorkerRegister(worker_id=worker_id, models=(ServedModelInfo(name="m", max_model_len=1),),
                              device="cpu", pid=0, capacity=capacity)
    return WorkerConn(register, writer=cast(asyncio.StreamWriter, None))


def _job(n: int) -> Job:
    request = GenerateRequest(request_id=f"bench-{n}", tenant_id="t", model="m", priority=Priority.STANDARD,
                              prompt_token_ids=(1,), sampling=SamplingParams(max_tokens=1), cache_salt="t",
                              arrival_time=time.time())
    return Job(state=RequestState.of(request, "default"), sink=lambda delta: None)


def _summary(values: list[float]) -> dict[str, float | None]:
    return {"p50_us": percentile(values, 50), "p99_us": percentile(values, 99), "n": len(values)}


async def run(url: str, takes: int, replicas: int, workers: int) -> dict[str, object]:
    prefix = f"sluice-bench-{secrets.token_hex(4)}"
    candidates = [_worker(f"w{i}") for i in range(workers)]
    local = LocalSlots()
    local_us: list[float] = []
    for n in range(takes):
        start = time.perf_counter()
        local.take(_job(n), candidates, 2, True)
        local_us.append((time.perf_counter() - start) * 1e6)

    clients = [Redis.from_url(url) for _ in range(replicas)]
    take_us: list[float] = []
    sync_us: list[float] = []

    async def loop(index: int) -> None:
        slots = RedisSlots(clients[index], prefix=prefix, lease_s=10.0, replica=f"bench-{index}")
        scheduler: FairScheduler[str] = FairScheduler(ClassPolicy(), shared_counters=True)
        fairness = RedisFairness(clients[index], prefix=prefix, lease_s=10.0, replica=f"bench-{index}")
        fairness.bind(scheduler)
        for n in range(takes):
            job = _job(n)
            start = time.perf_counter()
            got = await slots.take(job, candidates, 2, True)
            take_us.append((time.perf_counter() - start) * 1e6)
            assert got is not None
            slots.release(job)
            await slots.flush()
            if n % 10 == 0:  # a sync per ten dispatches: about the 25 ms cadence at 400 dispatches/s
                scheduler.push(Pending(request_id=job.request_id, tenant=f"t{n % 7}", priority=Priority.STANDARD,
                                       enqueued_at=n, payload=job.request_id, prompt_tokens=10))
                scheduler.charge(f"t{n % 5}", Priority.STANDARD, 20)
                start = time.perf_counter()
                await fairness.sync()
                sync_us.append((time.perf_counter() - start) * 1e6)

    try:
        await asyncio.gather(*(loop(i) for i in range(replicas)))
    finally:
        keys = [key async for key in clients[0].scan_iter(match=f"{prefix}:*", count=500)]
        if keys:
            await clients[0].delete(*keys)
        for client in clients:
            await client.aclose()
    return {"replicas": replicas, "workers": workers, "in_process_take": _summary(local_us),
            "redis_take": _summary(take_us), "redis_fair_sync": _summary(sync_us)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--takes", type=int, default=2000, help="per replica")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="candidate workers per take")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.takes < 1 or args.replicas < 1 or args.workers < 1:
        parser.error("--takes, --replicas and --workers must be at least 1")
    result = asyncio.run(run(args.redis_url, args.takes, args.replicas, args.workers))
    for name in ("in_process_take", "redis_take", "redis_fair_sync"):
        row = cast(dict[str, float], result[name])
        print(f"{name:16} p50 {row['p50_us']:8.0f} us   p99 {row['p99_us']:8.0f} us   (n={row['n']:.0f})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
