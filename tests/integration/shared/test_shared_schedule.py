"""One global schedule across replicas, on the real Redis: the worker slots (`max_worker_waiting`
and the priority room rule on every replica's counts) and the fair scheduler's shared counters.

Each "replica" is what a gateway process has: its own Redis client, its quota ledger's lease
renewer, and the slots filed under the same replica id.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import pytest
from redis.asyncio import Redis

from sluice.gateway.dispatch import Job, WorkerConn
from sluice.gateway.redis_ledger import RedisLedger
from sluice.gateway.slots import RedisSlots
from sluice.protocol import GenerateRequest, Priority, SamplingParams, ServedModelInfo, WorkerCapacity, WorkerRegister
from sluice.telemetry import percentile

pytestmark = pytest.mark.integration

HI, S, B = Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH
_ids = itertools.count()


def job(priority: Priority = B, tenant: str = "t") -> Job:
    request = GenerateRequest(
        request_id=f"r{next(_ids)}", tenant_id=tenant, model="demo", priority=priority, prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(max_tokens=4), cache_salt=tenant, arrival_time=time.time())
    return Job(request=request, sink=lambda delta: None)


def worker(worker_id: str, num_waiting: int = 0) -> WorkerConn:
    """A worker as a replica sees it after registration (no socket: these tests never send)."""
    capacity = WorkerCapacity(worker_id=worker_id, num_running=0, num_waiting=num_waiting, free_kv_blocks=100,
                              total_kv_blocks=100, max_num_seqs=4, sent_at=time.time())
    register = WorkerRegister(worker_id=worker_id, models=(ServedModelInfo(name="demo", max_model_len=512),),
                              device="cpu", pid=1, capacity=capacity)
    return WorkerConn(register, writer=cast(asyncio.StreamWriter, None))


@dataclass
class Replica:
    slots: RedisSlots
    ledger: RedisLedger  # renews the lease the slots are filed under, as in a gateway process


MakeReplicas = Callable[[int], Awaitable[list[Replica]]]


@pytest.fixture
async def slot_replicas(redis_url: str, prefix: str, lease_s: float) -> AsyncIterator[MakeReplicas]:
    made: list[tuple[Replica, Redis]] = []

    async def make(count: int) -> list[Replica]:
        out = []
        for index in range(len(made), len(made) + count):
            client = Redis.from_url(redis_url)
            name = f"replica-{index}"
            ledger = RedisLedger(client, prefix=prefix, lease_s=lease_s, replica=name)
            await ledger.start()
            replica = Replica(RedisSlots(client, prefix=prefix, lease_s=lease_s, replica=name), ledger)
            made.append((replica, client))
            out.append(replica)
        return out

    yield make
    for replica, client in made:
        await replica.slots.flush()
        await replica.ledger.stop()
        await client.aclose()


async def counts(redis: Redis, prefix: str, worker_id: str) -> dict[int, int]:
    raw = await redis.hgetall(f"{prefix}:ws:{worker_id}")
    return {int(k): int(v) for k, v in raw.items() if int(v)}


async def test_the_bound_is_exact_under_concurrent_takes_from_two_replicas(
        slot_replicas: MakeReplicas, redis: Redis, prefix: str) -> None:
    a, b = await slot_replicas(2)
    workers = [worker("w1"), worker("w2"), worker("w3")]
    limit = 2
    held: dict[str, int] = {w.worker_id: 0 for w in workers}  # taken and not yet released, as the takers see it
    peak: dict[str, int] = dict(held)
    taken_us: list[float] = []

    async def taker(slots: RedisSlots, rounds: int) -> None:
        for _ in range(rounds):
            j = job()
            started = time.perf_counter()
            got = await slots.take(j, workers, limit, True)
            taken_us.append((time.perf_counter() - started) * 1e6)
            if got is None:
                await asyncio.sleep(0)
                continue
            held[got.worker_id] += 1
            peak[got.worker_id] = max(peak[got.worker_id], held[got.worker_id])
            await asyncio.sleep(0.001)
            held[got.worker_id] -= 1  # before Redis hears of it: the count here can only be lower
            slot = j.slot
            j.slot = ""
            await slots._release_now([slot])

    # Fill first: 8 tasks over two replicas race for 6 slots; exactly 6 are given.
    fill = [job() for _ in range(40)]
    results = await asyncio.gather(*(
        (a if i % 2 else b).slots.take(j, workers, limit, True) for i, j in enumerate(fill)))
    assert sum(r is not None for r in results) == 3 * limit
    for w in workers:
        assert await counts(redis, prefix, w.worker_id) == {int(B): limit}
    for i, j in enumerate(fill):
        (a if i % 2 else b).slots.release(j)
    await a.slots.flush()
    await b.slots.flush()
    assert [await counts(redis, prefix, w.worker_id) for w in workers] == [{}, {}, {}]

    # Churn: take, hold briefly, release, from 8 tasks on two replicas.
    await asyncio.gather(*(taker(r.slots, 60) for r in (a, b) for _ in range(4)))
    assert max(peak.values()) == limit  # reached, never passed
    assert [await counts(redis, prefix, w.worker_id) for w in workers] == [{}, {}, {}]
    taken_us.sort()
    print(f"\ntake (8 concurrent takers, 2 replicas): p50 {percentile(taken_us, 50):.0f} us, "
          f"p99 {percentile(taken_us, 99):.0f} us over {len(taken_us)} takes")


async def test_interactive_work_overtakes_batch_work_another_replica_sent(
        slot_replicas: MakeReplicas, redis: Redis, prefix: str) -> None:
    a, b = await slot_replicas(2)
    w = worker("w1")
    # Replica B filled the worker's waiting queue with batch work.
    batch = [job(B), job(B)]
    assert [await b.slots.take(j, [w], 2, True) for j in batch] == [w, w]
    # Replica A knows none of it, yet: more batch work is refused, interactive work overtakes it,
    # and its own class stays bounded.
    assert await a.slots.take(job(B), [w], 2, True) is None
    assert await a.slots.take(job(S), [w], 2, True) is w  # standard overtakes batch too
    assert [await a.slots.take(job(HI), [w], 2, True) for _ in range(3)] == [w, w, None]  # 2 of its class
    assert await a.slots.take(job(S), [w], 2, True) is None  # 3 ahead of it now
    assert await counts(redis, prefix, "w1") == {int(HI): 2, int(S): 1, int(B): 2}
    # With priority off, one class: the plain bound, nothing overtakes.
    assert await a.slots.take(job(HI), [worker("w2", num_waiting=2)], 2, False) is None


async def test_the_first_candidate_with_room_gets_the_job(slot_replicas: MakeReplicas) -> None:
    (a,) = await slot_replicas(1)
    full, reported_full, free = worker("w1"), worker("w2", num_waiting=2), worker("w3")
    assert [await a.slots.take(job(), [full], 2, True) for _ in range(2)] == [full, full]
    # w2 has no slot taken anywhere but reported two waiting (e.g. preempted work): still full.
    assert await a.slots.take(job(), [full, reported_full, free], 2, True) is free


async def test_a_replica_whose_lease_lapses_gives_its_slots_back(
        slot_replicas: MakeReplicas, redis: Redis, prefix: str, lease_s: float) -> None:
    a, b = await slot_replicas(2)
    w = worker("w1")
    assert [await b.slots.take(job(), [w], 2, True) for _ in range(2)] == [w, w]
    await b.ledger.stop_renewing()  # as a SIGKILLed replica: no release, no renewal
    assert await a.slots.take(job(), [w], 2, True) is None  # still counted: its lease runs
    deadline = time.monotonic() + lease_s + 10
    while (got := await a.slots.take(job(), [w], 2, True)) is None:
        assert time.monotonic() < deadline, "the lapsed replica's slots were never released"
        await asyncio.sleep(0.1)
    assert got is w
    assert await redis.exists(f"{prefix}:slots:replica-1") == 0
    assert await counts(redis, prefix, "w1") == {int(B): 1}


async def test_a_clean_stop_gives_the_slots_back_at_once(
        slot_replicas: MakeReplicas, redis: Redis, prefix: str) -> None:
    a, b = await slot_replicas(2)
    w = worker("w1")
    assert [await b.slots.take(job(), [w], 2, True) for _ in range(2)] == [w, w]
    await b.ledger.stop()  # gives the lease up: the next script sweeps it
    assert await a.slots.take(job(), [w], 2, True) is w
