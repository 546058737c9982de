"""KafkaBackend + real worker processes: streaming, priority, fairness, disconnect, worker death.

One worker process per module (max_num_seqs 2) on a fixed free port; each test starts its own
backend (fresh topics) on that port and the worker reconnects to it, as after a gateway restart.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import msgspec
import pytest
from sluice_testing import drain, submit

from sluice.broker import free_port
from sluice.gateway.queueing.acceptance import KafkaBackend
from sluice.gateway.queueing.backend import BackendUnavailable
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams

from .conftest import kill_group, make_settings, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_ids = itertools.count()


def request(tenant: str, priority: Priority, max_tokens: int, weight: float = 1.0) -> GenerateRequest:
    n = next(_ids)
    return GenerateRequest(
        request_id=f"req-{n}", tenant_id=tenant, model="demo", priority=priority,
        prompt_token_ids=tuple(range(5, 5 + 12 + n % 5)),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt=tenant, arrival_time=time.time(), tenant_weight=weight,
    )


@pytest.fixture(scope="module")
def worker_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(start_worker, demo_model_dir: Path, worker_port: int):
    return start_worker(demo_model_dir, worker_port, "w1", "--max-num-seqs", "2")


@pytest.fixture
async def backend(bootstrap_servers: str, demo_model_dir: Path, worker_port: int, worker):
    backend = KafkaBackend(make_settings(bootstrap_servers, demo_model_dir), worker_port=worker_port)
    await backend.start()
    try:
        await wait_for(lambda: "w1" in backend.dispatcher.workers, 120, "the worker to register")
        yield backend
    finally:
        await backend.stop()


async def test_stream_completes_with_every_token(backend: KafkaBackend) -> None:
    sub = await submit(backend, request("alice", Priority.STANDARD, 8))
    deltas = await asyncio.wait_for(drain(sub), 60)
    final = deltas[-1]
    assert final.finish_reason == FinishReason.LENGTH
    assert sum(len(d.token_ids) for d in deltas) == 8 == final.num_output_tokens
    assert final.first_token_time is not None  # the worker's clock, for gateway-overhead records
    assert backend.dispatcher.num_jobs == 0
    snap = backend.snapshot()
    assert snap["workers"][0]["worker_id"] == "w1"
    assert snap["queues"]["classes"]["standard"]["depth"] == 0


async def test_stream_is_dispatched_on_acceptance_and_its_record_finished_later(backend: KafkaBackend) -> None:
    """No consumer round trip before dispatch: the job exists once submit() returns; the consumer
    reading the record afterwards only finishes its offset (not an orphan, not a second job)."""
    sub = await submit(backend, request("alice", Priority.INTERACTIVE, 4))
    assert sub.state.worker == "" or sub.state.worker
    deltas = await asyncio.wait_for(drain(sub), 60)
    assert deltas[-1].num_output_tokens == 4
    consumer = backend._consumers[Priority.INTERACTIVE]
    await wait_for(lambda: consumer.records_read >= 1 and consumer.num_unfinished == 0, 30,
                   "the consumer to read and finish the record")
    assert backend.replayed_orphans == 0 and backend.dispatcher.num_jobs == 0
    assert backend.dispatcher.workers["w1"].sent >= 1


async def test_interactive_jumps_the_batch_queue_and_preempts(backend: KafkaBackend) -> None:
    batch = [await submit(backend, request(f"bulk{i % 2}", Priority.BATCH, 160)) for i in range(7)]
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    reasons: dict[str, FinishReason] = {}

    async def watch(sub) -> None:
        async for delta in sub:
            if delta.token_ids and sub.request_id not in first_token:
                first_token[sub.request_id] = time.monotonic()
            if delta.finish_reason is not None:
                finished[sub.request_id] = time.monotonic()
                reasons[sub.request_id] = delta.finish_reason

    watchers = [asyncio.create_task(watch(s)) for s in batch]
    # Saturate: both engine slots busy with batch work, two more waiting at the worker, and batch
    # work queued at the gateway.
    await wait_for(lambda: len(first_token) >= 2, 60, "batch work to start")
    running_at_submit = set(first_token) - set(finished)
    interactive = await submit(backend, request("chat", Priority.INTERACTIVE, 4))
    await asyncio.wait_for(watch(interactive), 60)
    ij = interactive.state
    assert ij is not None and ij.dispatch_time is not None
    # No batch request went out between the interactive one entering the scheduler and its dispatch
    # (FIFO would have sent the batch head first), and batch work queued then went out after it.
    later = [s for s in batch if s.dispatch_time is None or s.dispatch_time > ij.queued_at]
    assert later
    assert all(s.dispatch_time is None or s.dispatch_time >= ij.dispatch_time for s in later)
    # Served while batch work held both engine slots: with max_num_seqs 2, a third stream can only
    # run if the engine preempted one of them for it.
    inter_first = first_token[interactive.request_id]
    still_running = [rid for rid in running_at_submit if finished.get(rid, float("inf")) > inter_first]
    assert still_running
    if len(still_running) == 2:
        assert backend.dispatcher.workers["w1"].capacity.num_preemptions > 0
    for sub in batch:  # enough seen: end the rest early
        await sub.abort()
    await asyncio.wait_for(asyncio.gather(*watchers), 120)
    assert len(finished) == 8  # every stream ended with a final delta: nothing lost
    assert set(reasons.values()) <= {FinishReason.LENGTH, FinishReason.ABORT}


async def submit_all_then_dispatch(backend: KafkaBackend, requests: list[GenerateRequest]) -> list:
    """Every request is queued before the scheduler picks any (the worker is drained meanwhile), so
    the dispatch order is the scheduler's decision and not a race with how fast the machine runs."""
    assert backend.dispatcher.drain("w1")
    try:
        subs = [await submit(backend, r) for r in requests]
    finally:
        assert backend.dispatcher.undrain("w1")
    await asyncio.wait_for(asyncio.gather(*(drain(s) for s in subs)), 240)
    return sorted(subs, key=lambda s: s.state.dispatch_time)


async def test_equal_weights_light_tenant_is_not_starved(backend: KafkaBackend) -> None:
    requests = [request("heavy", Priority.STANDARD, 6) for _ in range(20)]
    requests += [request("light", Priority.STANDARD, 6) for _ in range(2)]
    order = [s.request_id for s in await submit_all_then_dispatch(backend, requests)]
    light = [order.index(r.request_id) for r in requests[20:]]
    # FIFO would dispatch the light tenant 21st and 22nd, after all the heavy work queued before
    # it; VTC sends it as soon as the heavy tenant's served tokens pass its own (the first
    # dispatches, before any token is served, are ties that the older heavy head wins).
    assert max(light) < 8, order


async def test_weights_two_to_one_split_dispatches_two_to_one(backend: KafkaBackend) -> None:
    requests = []
    for _ in range(12):  # interleaved arrivals
        requests.append(request("gold", Priority.STANDARD, 6, weight=2.0))
        requests.append(request("bronze", Priority.STANDARD, 6, weight=1.0))
    tenant = {r.request_id: r.tenant_id for r in requests}
    order = await submit_all_then_dispatch(backend, requests)
    first = [tenant[s.request_id] for s in order[:12]]
    assert 7 <= first.count("gold") <= 10, first  # 8 of 12 is the exact 2:1 split


async def test_client_disconnect_frees_blocks_within_a_step(backend: KafkaBackend) -> None:
    dispatcher = backend.dispatcher
    sub = await submit(backend, request("alice", Priority.STANDARD, 2000))
    iterator = sub.__aiter__()
    await asyncio.wait_for(iterator.__anext__(), 60)  # streaming: it holds KV blocks now
    worker = dispatcher.workers["w1"]
    await wait_for(lambda: worker.capacity.num_running == 1, 30, "the request to run")
    assert worker.capacity.free_kv_blocks < worker.capacity.total_kv_blocks
    await sub.abort()
    await sub.abort()  # idempotent
    await wait_for(lambda: worker.capacity.num_running == 0
                   and worker.capacity.free_kv_blocks == worker.capacity.total_kv_blocks
                   and dispatcher.num_jobs == 0, 30, "the worker to free the request's blocks")


async def test_draining_worker_finishes_its_jobs_and_gets_no_new_ones(backend: KafkaBackend) -> None:
    dispatcher = backend.dispatcher
    running = await submit(backend, request("alice", Priority.STANDARD, 40))
    iterator = running.__aiter__()
    await asyncio.wait_for(iterator.__anext__(), 60)  # on the worker now
    assert dispatcher.drain("w1") and not dispatcher.drain("no-such-worker")
    assert backend.snapshot()["workers"][0]["draining"] is True
    waiting = await submit(backend, request("bob", Priority.STANDARD, 4))
    rest = await asyncio.wait_for(drain_iter(iterator), 60)
    assert rest[-1].finish_reason == FinishReason.LENGTH and rest[-1].num_output_tokens == 40
    await asyncio.sleep(1.0)  # heartbeats come and go; the drained worker still gets nothing
    assert waiting.state.worker == ""
    assert backend.snapshot()["queues"]["classes"]["standard"]["depth"] == 1
    assert dispatcher.undrain("w1") and not dispatcher.undrain("w1")
    deltas = await asyncio.wait_for(drain(waiting), 60)
    assert deltas[-1].num_output_tokens == 4 and dispatcher.num_jobs == 0
    assert backend.snapshot()["workers"][0]["draining"] is False


async def drain_iter(iterator) -> list[RequestDelta]:
    return [delta async for delta in iterator]


async def test_a_stream_whose_lone_worker_dies_resumes_on_it_once_restarted(
        bootstrap_servers: str, demo_model_dir: Path, start_worker) -> None:
    """Worker failover with no other worker: the stream waits in the queue (a stall, no error) and
    resumes after its delivered tokens once the worker is back under its id, as `serve` restarts it."""
    port = free_port()
    backend = KafkaBackend(make_settings(bootstrap_servers, demo_model_dir), worker_port=port)
    await backend.start()
    process = start_worker(demo_model_dir, port, "doomed", "--max-num-seqs", "2")
    try:
        await wait_for(lambda: "doomed" in backend.dispatcher.workers, 120, "the worker to register")
        # Long enough that the kill lands mid-stream: with the skinny decode kernel a demo-model
        # worker finished 60 tokens before the kill (the job then never went back to the queue).
        max_tokens = 400
        first = request("alice", Priority.STANDARD, max_tokens)
        sub = await submit(backend, first)
        iterator = sub.__aiter__()
        head = [await asyncio.wait_for(iterator.__anext__(), 60)]
        kill_group(process)
        await wait_for(lambda: "doomed" not in backend.dispatcher.workers, 30, "the worker to be dropped")
        assert sub.state.worker == "" and backend.dispatcher.num_jobs == 1  # queued
        start_worker(demo_model_dir, port, "doomed", "--max-num-seqs", "2")
        rest = await asyncio.wait_for(drain_iter(iterator), 120)
        deltas = head + rest
        assert all(d.finish_reason is None for d in deltas[:-1]) and deltas[-1].error is None
        assert deltas[-1].finish_reason == FinishReason.LENGTH and deltas[-1].num_output_tokens == max_tokens
        assert len(sub.state.request.resume_token_ids) >= 1 and sub.state.attempts == 2
        again = await submit(backend, msgspec.structs.replace(first, request_id=f"{first.request_id}-again"))
        undisturbed = await asyncio.wait_for(drain(again), 120)
        assert [t for d in deltas for t in d.token_ids] == [t for d in undisturbed for t in d.token_ids]
        assert "".join(d.text for d in deltas) == "".join(d.text for d in undisturbed)
        assert backend.dispatcher.num_jobs == 0
    finally:
        await backend.stop()


async def test_broker_gone_gives_backend_unavailable_quickly(demo_model_dir: Path) -> None:
    from sluice.broker import EmbeddedBroker

    broker = EmbeddedBroker().start()
    backend = KafkaBackend(make_settings(broker.bootstrap_servers, demo_model_dir), worker_port=0)
    try:
        await backend.start()
        broker.stop()
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match=r"did not acknowledge|rejected"):
            await submit(backend, request("alice", Priority.STANDARD, 4))
        assert time.monotonic() - started < 30  # bounded by produce_timeout_s, not aiokafka's retries
        assert not (await backend.ready())["broker"]
    finally:
        await backend.stop()
        broker.stop()


async def test_replayed_request_without_its_client_is_finished_without_generation(
        backend: KafkaBackend) -> None:
    from sluice.gateway.queueing.kafka import RequestLog

    # Written by "another gateway process" (one that died): nobody here holds its stream.
    orphan_log = RequestLog(backend.settings.kafka)
    await orphan_log.start()
    try:
        await orphan_log.append(request("ghost", Priority.STANDARD, 4))
    finally:
        await orphan_log.stop()
    await wait_for(lambda: backend.replayed_orphans == 1, 30, "the orphan to be consumed")
    consumer = backend._consumers[Priority.STANDARD]
    await wait_for(lambda: consumer.num_unfinished == 0, 30, "its offset to be finished")
    assert backend.dispatcher.num_jobs == 0
    assert backend.dispatcher.workers["w1"].sent == 0  # never dispatched


async def test_backlog_bound_pauses_the_class_consumer(bootstrap_servers: str, demo_model_dir: Path) -> None:
    from sluice.settings import SchedulerSettings

    # No worker at this backend: everything it consumes stays queued in memory.
    settings = make_settings(bootstrap_servers, demo_model_dir,
                             scheduler=SchedulerSettings(aging_s=0.0, max_backlog_per_class=8))
    backend = KafkaBackend(settings, worker_port=0)
    await backend.start()
    try:
        subs = [await submit(backend, request(f"t{i % 3}", Priority.BATCH, 4)) for i in range(30)]
        consumer = backend._consumers[Priority.BATCH]
        await wait_for(lambda: consumer.paused, 30, "the batch consumer to pause")
        await asyncio.sleep(0.5)
        # Streams are dispatched by their acceptor at once (bounded by the quotas' max_queued, not
        # by this bound); they count toward their class's backlog, which pauses its consumer.
        assert backend.dispatcher.num_jobs == 30
        assert backend._consumers[Priority.INTERACTIVE].paused is False
        snap = backend.snapshot()["queues"]
        assert snap["classes"]["batch"]["depth"] == backend.dispatcher.num_jobs
        assert snap["consumers"]["batch"]["paused"] is True
        # Clients go away: queued jobs end, the consumer resumes, the rest finish unseen.
        for sub in subs:
            await sub.abort()
        await wait_for(lambda: backend.dispatcher.num_jobs == 0 and consumer.num_unfinished == 0
                       and not consumer.paused and consumer.records_read >= 30,
                       30, "every request to be finished")
        assert backend.replayed_orphans == 0  # every record was accepted (and dispatched) here
    finally:
        await backend.stop()
