"""Issue #15 acceptance, one schedule over the cluster: the single-gateway fairness tests hold with
requests spread over 3 replicas (Jain >= 0.95 at 10x skew, 2:1 weights -> 2:1 +- 10%), a light
tenant served from one replica is not out-shared by a heavy tenant on all three, and interactive
requests overtake a batch backlog accepted on other replicas.

Method: every worker is kept full (its engine's seats and its waiting queue) by a blocker
tenant's long requests while all requests are accepted; then the blockers are cancelled, so the
order the workers run the requests in is the schedule's decision and not a race with how fast 2
busy cores accept 100 HTTP requests. Meanwhile every replica holding requests is refused a slot
and files its head job (gateway/dispatch/slots.py), so all of them contend for the first freed slot.
(Draining the workers on every replica and undraining them, as tests/integration/dispatch does
with one gateway, was flaky here: the replicas take the undrain at moments up to a few hundred
ms apart on the busy machine, and the first back alone fills every freed slot meanwhile, its own
light requests first and then heavy ones only: CI measured Jain 0.80.)
The order is read worker-side: each request's first scheduling on an engine (the replicas'
records). Tokens per tenant are counted over the dispatches made while both tenants were
backlogged. Workers run 2 sequences each, so the schedule, not the engines, decides.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets

import httpx
import openai
import pytest

from sluice.telemetry import RequestRecord
from sluice_lab.experiments.cluster import Cluster

from .helpers import complete, until, wait_records

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.postgres]

MAX_WORKER_WAITING = 2  # dispatch.max_worker_waiting (the default)
WORKER_MAX_NUM_SEQS = 2
# A blocker runs this long (its worker's engine at 2 sequences: tens of seconds here), far longer
# than accepting the requests takes; it is cancelled once they are queued.
BLOCKER_TOKENS = 3000


@pytest.fixture(scope="module")
def cluster_overrides() -> dict[str, object]:
    # No aging: a batch backlog older than aging_s would rightly go first and hide the class order.
    return {"worker_max_num_seqs": WORKER_MAX_NUM_SEQS, "sluice_toml": "[scheduler]\naging_s = 0.0\n"}


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def queued(cluster: Cluster) -> int:
    total = 0
    for replica in cluster.replicas:
        classes = cluster.admin("GET", "/queues", replica=replica.index)["queues"]["classes"]
        total += sum(lane["depth"] for lane in classes.values())
    return total


def worker_load(cluster: Cluster) -> list[tuple[int, int]]:
    """(running, waiting) of each worker, as its engine last reported them (to replica 0)."""
    return [(w["num_running"], w["num_waiting"]) for w in cluster.admin("GET", "/workers")["workers"]]


async def run_contended(cluster: Cluster, requests: list[tuple[int, str]], max_tokens: int = 8) -> None:
    """Accept every (replica, key) request while the workers are full of blockers, then cancel
    the blockers (module docstring): every replica contends for the first freed slot."""
    blocker = cluster.new_tenant(f"blocker-{secrets.token_hex(3)}")[2]
    full = [(WORKER_MAX_NUM_SEQS, MAX_WORKER_WAITING)] * len(cluster.workers)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        blockers = [asyncio.create_task(complete(client, cluster, 0, blocker, max_tokens=BLOCKER_TOKENS,
                                                 ignore_eos=True)) for _ in range(len(full) * sum(full[0]))]
        try:
            async def workers_full() -> bool:
                return sorted(await asyncio.to_thread(worker_load, cluster)) == full

            await until(workers_full, 120, f"every worker full of blockers {full}", interval_s=0.2)
            calls = [asyncio.create_task(complete(client, cluster, replica, key, max_tokens=max_tokens,
                                                  ignore_eos=True)) for replica, key in requests]

            async def all_queued() -> bool:
                return await asyncio.to_thread(queued, cluster) >= len(requests)

            await until(all_queued, 120, f"{len(requests)} queued requests", interval_s=0.2)
            assert not any(b.done() for b in blockers), "a blocker ended before the requests queued: make it longer"
        finally:
            for task in blockers:  # the client goes away: each blocker is aborted at its worker
                task.cancel()
            await asyncio.gather(*blockers, return_exceptions=True)
        answers = await asyncio.gather(*calls)
    assert all(a.status_code == 200 for a in answers), {a.status_code for a in answers}


def served_order(records: list[RequestRecord]) -> list[RequestRecord]:
    ran = [r for r in records if r.engine_first_scheduled is not None]
    return sorted(ran, key=lambda r: r.engine_first_scheduled or 0.0)


def tokens_by_tenant(order: list[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for record in order:
        out[record.tenant] = out.get(record.tenant, 0) + record.prompt_tokens + record.completion_tokens
    return out


def spread(key: str, count: int, replicas: list[int]) -> list[tuple[int, str]]:
    cycle = itertools.cycle(replicas)
    return [(next(cycle), key) for _ in range(count)]


def interleave(*lists: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return [item for group in itertools.zip_longest(*lists) for item in group if item is not None]


async def check_jain(cluster: Cluster, light_replicas: list[int], label: str) -> None:
    tag = secrets.token_hex(3)
    heavy_name, light_name = f"heavy-{tag}", f"light-{tag}"
    heavy = cluster.new_tenant(heavy_name)[2]
    light = cluster.new_tenant(light_name)[2]
    every = [r.index for r in cluster.replicas]
    heavy_n, light_n = 100, 10  # 10x skew
    await run_contended(cluster, interleave(spread(heavy, heavy_n, every), spread(light, light_n, light_replicas)))
    records = (await wait_records(cluster, heavy_name, heavy_n)) + (await wait_records(cluster, light_name, light_n))
    order = served_order(records)
    contended = order[:2 * light_n]  # while the light tenant still had work queued, if served fairly
    served = tokens_by_tenant(contended)
    index = jain([served.get(heavy_name, 0), served.get(light_name, 0)])
    light_positions = [i for i, r in enumerate(order) if r.tenant == light_name]
    print(f"\nfairness ({label}): first {len(contended)} served: heavy {served.get(heavy_name, 0)} tokens, light "
          f"{served.get(light_name, 0)} tokens, Jain {index:.3f}; light served at positions {light_positions}")
    assert index >= 0.95


async def test_ten_to_one_skew_spread_over_replicas_is_fair(cluster: Cluster) -> None:
    await check_jain(cluster, [r.index for r in cluster.replicas], "both tenants on every replica")


async def test_light_tenant_on_one_replica_is_not_out_shared_by_heavy_on_all(cluster: Cluster) -> None:
    """Per-replica fairness would serve heavy alone on the two replicas light never reaches."""
    await check_jain(cluster, [len(cluster.replicas) - 1], "light tenant on one replica only")


async def test_weights_two_to_one_over_replicas_give_two_to_one_tokens(cluster: Cluster) -> None:
    tag = secrets.token_hex(3)
    gold_name, bronze_name = f"gold-{tag}", f"bronze-{tag}"
    gold = cluster.new_tenant(gold_name, weight=2.0)[2]
    bronze = cluster.new_tenant(bronze_name, weight=1.0)[2]
    every = [r.index for r in cluster.replicas]
    # The served order keeps within ~2.5 requests of the exact 2:1 sequence at every prefix (measured
    # over 4 runs), a bounded error: over 60 dispatches that alone is 1.69, over 180 it is 1.89.
    per_tenant = 135
    await run_contended(cluster, interleave(spread(gold, per_tenant, every), spread(bronze, per_tenant, every[::-1])))
    records = (await wait_records(cluster, gold_name, per_tenant)) + (await wait_records(cluster, bronze_name,
                                                                                         per_tenant))
    contended = served_order(records)[:180]  # gold would run out at 202 of 270 at exactly 2:1
    served = tokens_by_tenant(contended)
    ratio = served.get(gold_name, 0) / max(1, served.get(bronze_name, 0))
    print(f"\nweights 2:1 over replicas: first {len(contended)} served: gold {served.get(gold_name, 0)} tokens, "
          f"bronze {served.get(bronze_name, 0)} tokens, ratio {ratio:.2f}")
    assert 1.8 <= ratio <= 2.2


def batch_file(n: int, max_tokens: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"b-{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "demo", "prompt": f"document {i}", "max_tokens": max_tokens,
                                        "temperature": 0, "ignore_eos": True}}) + "\n"
                   for i in range(n)).encode()


@pytest.mark.timeout(900)
async def test_interactive_overtakes_a_batch_backlog_accepted_on_other_replicas(cluster: Cluster) -> None:
    tag = secrets.token_hex(3)
    batch_name, chat_name = f"nightly-{tag}", f"chat-{tag}"
    batch_key = cluster.new_tenant(batch_name, priority_ceiling="batch", default_class="batch")[2]
    chat_key = cluster.new_tenant(chat_name, priority_ceiling="interactive", default_class="interactive")[2]
    # 20 run before the interactive requests and a few dozen while they go; the rest is cancelled.
    # Sized for a fast engine, not a slow one: with the skinny decode kernel (kernels/cpu_gemv.py)
    # CI saw 160 lines of 16 tokens gone before the 6th request.
    lines, line_tokens = 400, 48
    client = openai.OpenAI(api_key=batch_key, base_url=cluster.replicas[1].base_url + "/v1", max_retries=3)
    uploaded = await asyncio.to_thread(client.files.create, file=("backlog.jsonl", batch_file(lines, line_tokens)),
                                       purpose="batch")
    batch = await asyncio.to_thread(client.batches.create, input_file_id=uploaded.id,
                                    endpoint="/v1/completions", completion_window="24h")

    def completed() -> int:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts.completed if counts else 0

    async def saturated() -> bool:  # both workers busy with batch lines
        return await asyncio.to_thread(completed) >= 20

    await until(saturated, 600, "the batch backlog to run", interval_s=0.2)
    interactive = 6
    async with httpx.AsyncClient(timeout=120) as http:
        for _ in range(interactive):  # one after another, all on replica 0, which accepted no batch
            answer = await complete(http, cluster, 0, chat_key, max_tokens=4, ignore_eos=True)
            assert answer.status_code == 200, answer.text
    backlog_left = lines - await asyncio.to_thread(completed)
    await asyncio.sleep(3.0)  # the lines running meanwhile finish and write their records
    chats = await wait_records(cluster, chat_name, interactive)
    lines_run = [r for r in cluster.records() if r.tenant == batch_name and r.engine_first_scheduled is not None]
    ahead = []
    for chat in chats:
        assert chat.engine_first_scheduled is not None and chat.priority_class == "interactive"
        ahead.append(sum(1 for r in lines_run if r.worker == chat.worker
                         and chat.arrival < (r.engine_first_scheduled or 0.0) < chat.engine_first_scheduled))
    waits = [round((c.engine_first_scheduled or 0.0) - c.arrival, 3) for c in chats]
    print(f"\npriority: {interactive} interactive requests on replica 0 during a {lines}-line batch accepted on "
          f"replica 1 ({backlog_left} lines still to do after them): batch lines started ahead of each on its "
          f"worker {ahead}; arrival -> first scheduled {waits} s")
    assert backlog_left > 0, "the backlog was gone before the interactive requests: make it longer"
    # FIFO would put each behind the whole backlog; one schedule lets only what already waited at
    # the worker (max_worker_waiting, for the whole cluster) start before it.
    assert max(ahead) <= MAX_WORKER_WAITING, ahead
    await asyncio.to_thread(client.batches.cancel, batch.id)
