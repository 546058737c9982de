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

from sluice.gateway.dispatch.dispatcher import Job
from sluice.gateway.dispatch.fair import ClassPolicy, FairScheduler, Pending
from sluice.gateway.dispatch.fair_shared import RedisFairness
from sluice.gateway.dispatch.links.tcp import WorkerConn
from sluice.gateway.dispatch.slots import RedisSlots
from sluice.gateway.generation.state import RequestState
from sluice.gateway.quotas.redis_ledger import RedisLedger
from sluice.protocol import GenerateRequest, Priority, SamplingParams, ServedModelInfo, WorkerCapacity, WorkerRegister
from sluice.telemetry import percentile

pytestmark = pytest.mark.integration

HI, S, B = Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH
_ids = itertools.count()


def job(priority: Priority = B, tenant: str = "t") -> Job:
    request = GenerateRequest(
        request_id=f"r{next(_ids)}", tenant_id=tenant, model="demo", priority=priority, prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(max_tokens=4), cache_salt=tenant, arrival_time=time.time())
    return Job(state=RequestState.of(request, "default"), sink=lambda delta: None)


def worker(worker_id: str, num_waiting: int = 0) -> WorkerConn:
    """A worker as a replica sees it after registration (no socket: these tests never send)."""
    capacity = WorkerCapacity(worker_id=worker_id, num_running=0, num_waiting=num_waiting, free_kv_blocks=100,
                              total_kv_blocks=100, max_num_seqs=4, sent_at=time.time())
    register = WorkerRegister(worker_id=worker_id, models=(ServedModelInfo(name="demo", max_model_len=512),),
                              device="cpu", pid=1, capacity=capacity)
    return WorkerConn(register, writer=cast(asyncio.StreamWriter, None), max_index_blocks=1000)


@dataclass
class Replica:
    """What a gateway process has: one Redis client and its ledger's lease renewer, the slots and
    the fairness counters filed under the same replica id (the fairness is synced by hand in
    these tests, once per step: no timing)."""

    client: Redis
    ledger: RedisLedger
    slots: RedisSlots
    scheduler: FairScheduler[str]
    fairness: RedisFairness


MakeReplicas = Callable[[int], Awaitable[list[Replica]]]


@pytest.fixture
async def make_replicas(redis_url: str, prefix: str, lease_s: float) -> AsyncIterator[MakeReplicas]:
    made: list[Replica] = []

    async def make(count: int) -> list[Replica]:
        for index in range(len(made), len(made) + count):
            client = Redis.from_url(redis_url)
            name = f"replica-{index}"
            ledger = RedisLedger(client, prefix=prefix, lease_s=lease_s, replica=name)
            await ledger.start()
            scheduler: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0), shared_counters=True)
            fairness = RedisFairness(client, prefix=prefix, lease_s=lease_s, replica=name)
            fairness.bind(scheduler)
            made.append(Replica(client, ledger, RedisSlots(client, prefix=prefix, lease_s=lease_s, replica=name),
                                scheduler, fairness))
        return made[-count:]

    yield make
    for replica in made:
        await replica.slots.flush()
        await replica.ledger.stop()
        await replica.client.aclose()


async def counts(redis: Redis, prefix: str, worker_id: str) -> dict[int, int]:
    raw = await redis.hgetall(f"{prefix}:ws:{worker_id}")
    return {int(k): int(v) for k, v in raw.items() if int(v)}


async def test_the_bound_is_exact_under_concurrent_takes_from_two_replicas(
        make_replicas: MakeReplicas, redis: Redis, prefix: str) -> None:
    a, b = await make_replicas(2)
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
        make_replicas: MakeReplicas, redis: Redis, prefix: str) -> None:
    a, b = await make_replicas(2)
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


async def test_the_first_candidate_with_room_gets_the_job(make_replicas: MakeReplicas) -> None:
    (a,) = await make_replicas(1)
    full, reported_full, free = worker("w1"), worker("w2", num_waiting=2), worker("w3")
    assert [await a.slots.take(job(), [full], 2, True) for _ in range(2)] == [full, full]
    # w2 has no slot taken anywhere but reported two waiting (e.g. preempted work): still full.
    assert await a.slots.take(job(), [full, reported_full, free], 2, True) is free


async def test_a_replica_whose_lease_lapses_gives_its_slots_back(
        make_replicas: MakeReplicas, redis: Redis, prefix: str, lease_s: float) -> None:
    a, b = await make_replicas(2)
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
        make_replicas: MakeReplicas, redis: Redis, prefix: str) -> None:
    a, b = await make_replicas(2)
    w = worker("w1")
    assert [await b.slots.take(job(), [w], 2, True) for _ in range(2)] == [w, w]
    await b.ledger.stop()  # gives the lease up: the next script sweeps it
    assert await a.slots.take(job(), [w], 2, True) is w


async def test_a_release_wakes_every_other_replica(make_replicas: MakeReplicas, redis_url: str, prefix: str,
                                                 lease_s: float) -> None:
    """The freed slot is announced: without it only the releasing replica woke at once and took
    it back, and the others (polling) could starve for dozens of dispatches."""
    (a,) = await make_replicas(1)
    listener = Redis.from_url(redis_url)
    b = RedisSlots(listener, prefix=prefix, lease_s=lease_s, replica="replica-b", subscription=listener)
    woken = {"a": asyncio.Event(), "b": asyncio.Event()}
    a.slots.on_release = woken["a"].set
    b.on_release = woken["b"].set
    await b.start()
    try:
        w = worker("w1")
        await asyncio.sleep(0.2)  # the subscription is in place (nothing below depends on timing)
        held = job()
        assert await a.slots.take(held, [w], 2, True) is w
        a.slots.release(held)
        await asyncio.wait_for(woken["b"].wait(), 10)  # the other replica heard it
        assert woken["a"].is_set()  # and the releasing one woke itself, as before
        woken["a"].clear()
        woken["b"].clear()
        mine = job()
        assert await b.take(mine, [w], 2, True) is w
        b.release(mine)
        await b.flush()
        assert woken["b"].is_set()  # its own release wakes it directly
        woken["b"].clear()
        await asyncio.sleep(0.2)
        assert not woken["b"].is_set()  # and its own announcement is not heard as another's
    finally:
        await b.stop()
        await listener.aclose()


async def test_a_freed_slot_goes_to_the_most_deserving_head_of_the_cluster(
        make_replicas: MakeReplicas) -> None:
    """Whichever replica's take reached Redis first used to win; now a replica whose head job has
    a larger counter is refused while another replica's refused head (smaller counter, or a more
    urgent class) is filed, until that head got its slot."""
    a, b = await make_replicas(2)
    w = worker("w1")
    held = [job(S), job(S)]
    assert [await a.slots.take(j, [w], 2, True, counter=5.0) for j in held] == [w, w]
    light, heavy = job(S, "light"), job(S, "heavy")
    assert await b.slots.take(light, [w], 2, True, counter=1.0) is None  # full: B's head is filed
    a.slots.release(held.pop())
    await a.slots.flush()
    assert await a.slots.take(heavy, [w], 2, True, counter=9.0) is None  # room, but B's head deserves it
    assert await b.slots.take(light, [w], 2, True, counter=1.0) is w
    assert await a.slots.take(heavy, [w], 2, True, counter=9.0) is None  # full again (no head in the way)
    a.slots.release(held.pop())
    await a.slots.flush()
    assert await a.slots.take(heavy, [w], 2, True, counter=9.0) is w  # B's head got its slot: dropped
    # A less urgent head does not hold a more urgent job back, whatever its counter.
    assert await b.slots.take(job(B, "light"), [w], 2, True, counter=0.0) is None  # full: filed
    assert await a.slots.take(job(HI, "heavy"), [w], 2, True, counter=9.0) is w  # overtakes the standard work


# ---- fairness: two replicas' schedulers ordering by the cluster's counters ------------------------

def pending(tenant: str, weight: float = 1.0, prompt: int = 10) -> Pending[str]:
    rid = f"{tenant}-{next(_ids)}"
    return Pending(request_id=rid, tenant=tenant, priority=S, enqueued_at=next(_ids) * 1e-6, payload=rid,
                   prompt_tokens=prompt, weight=weight)


async def serve(replicas: list[Replica] | list[FairScheduler[str]], steps: int,
                output_tokens: int = 20) -> dict[str, int]:
    """Each step every replica dispatches one item (its share of the workers) and it is served in
    full; then every replica syncs. Returns the tokens served per tenant."""
    served: dict[str, int] = {}
    for _ in range(steps):
        for replica in replicas:
            scheduler = replica.scheduler if isinstance(replica, Replica) else replica
            got = scheduler.pop(0.0)
            if got is None:
                continue
            scheduler.charge(got.tenant, got.priority, output_tokens)
            served[got.tenant] = served.get(got.tenant, 0) + got.prompt_tokens + output_tokens
        for replica in replicas:
            if isinstance(replica, Replica):
                await replica.fairness.sync()
    return served


def jain(values: list[int]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


async def test_ten_to_one_skew_over_two_replicas_is_served_fairly(make_replicas: MakeReplicas) -> None:
    """The heavy tenant sends ten times as much, spread over both replicas; the light one only
    reaches replica A. Replica B can only serve the heavy tenant, so A must count what B served:
    with the cluster's counters A serves the light tenant until it caught up."""
    a, b = await make_replicas(2)
    local_a: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0))
    local_b: FairScheduler[str] = FairScheduler(ClassPolicy(aging_s=0))
    for i in range(200):
        (a if i % 2 else b).scheduler.push(pending("heavy"))
        (local_a if i % 2 else local_b).push(pending("heavy"))
    for _ in range(20):
        a.scheduler.push(pending("light"))
        local_a.push(pending("light"))
    shared = await serve([a, b], 16)  # the light tenant stays backlogged throughout
    alone = await serve([local_a, local_b], 16)
    assert jain(list(shared.values())) >= 0.95, shared
    assert jain(list(alone.values())) < 0.9, alone  # each replica fair on its own is not enough


async def test_ten_to_one_skew_spread_over_both_replicas(make_replicas: MakeReplicas) -> None:
    a, b = await make_replicas(2)
    for i in range(200):
        (a if i % 2 else b).scheduler.push(pending("heavy"))
    for i in range(20):
        (b if i % 2 else a).scheduler.push(pending("light"))
    served = await serve([a, b], 8)
    assert jain(list(served.values())) >= 0.95, served


async def test_weights_two_to_one_over_two_replicas(make_replicas: MakeReplicas) -> None:
    a, b = await make_replicas(2)
    for i in range(120):
        (a if i % 2 else b).scheduler.push(pending("gold", weight=2.0))
        (b if i % 2 else a).scheduler.push(pending("bronze", weight=1.0))
    served = await serve([a, b], 45)
    assert 1.8 <= served["gold"] / served["bronze"] <= 2.2, served


async def test_a_tenant_joining_on_one_replica_is_lifted_to_the_clusters_backlogged(
        make_replicas: MakeReplicas) -> None:
    """VTC's lift, cluster-wide: a tenant idle everywhere that becomes backlogged on A, where no one
    else is, rises to the counters of the tenants backlogged on B, so it banks no idle credit
    for its later work on B; a tenant already backlogged on B is not lifted when it reaches A."""
    a, b = await make_replicas(2)
    for _ in range(40):
        b.scheduler.push(pending("busy"))
    await serve([a, b], 10)
    busy = b.scheduler.counter(S, "busy")
    assert busy == 300  # 10 items of 10 + 20 tokens
    a.scheduler.push(pending("newcomer"))
    await a.fairness.sync()
    assert a.scheduler.counter(S, "newcomer") == busy  # not 0: A alone knew no one to lift it to
    b.scheduler.push(pending("newcomer"))
    await b.fairness.sync()
    assert b.scheduler.counter(S, "newcomer") == busy
    a.scheduler.push(pending("busy"))
    await a.fairness.sync()
    assert a.scheduler.counter(S, "busy") == busy  # backlogged on B: its counter runs, no lift
