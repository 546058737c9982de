"""Dispatch through the shared store's worker slots (gateway/dispatch/slots.py): a KafkaBackend whose
shared state is the real Redis ($SLUICE_TEST_REDIS_URL), real worker processes.

Here (not in tests/integration/shared/) because the worker fixtures live in this directory.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sluice_testing import submit

from sluice.broker import free_port
from sluice.gateway.dispatch.dispatcher import SLOT_ERROR_RETRY_S
from sluice.gateway.queueing.acceptance import KafkaBackend
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams, WorkerCapacity
from sluice.settings import DispatchSettings, SharedSettings
from sluice_lab.experiments.cluster import drop_redis_prefix

from .conftest import make_settings, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "")
_ids = itertools.count()


def request(tenant: str, priority: Priority, max_tokens: int) -> GenerateRequest:
    n = next(_ids)
    return GenerateRequest(
        request_id=f"sreq-{n}", tenant_id=tenant, model="demo", priority=priority,
        prompt_token_ids=tuple(range(5, 5 + 12 + n % 5)),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt=tenant, arrival_time=time.time())


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    if not REDIS_URL:
        if os.environ.get("CI") == "true":
            pytest.fail("SLUICE_TEST_REDIS_URL is not set: under CI=true the shared-state tests must run")
        pytest.skip("SLUICE_TEST_REDIS_URL is not set (e.g. redis://127.0.0.1:6379/0); no shared store to test")
    name = f"sluice-test-{secrets.token_hex(6)}"
    yield name
    await drop_redis_prefix(REDIS_URL, name)


@pytest.fixture(scope="module")
def worker_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(start_worker, demo_model_dir: Path, worker_port: int):
    return start_worker(demo_model_dir, worker_port, "sw1", "--max-num-seqs", "2")


def watch_waiting(backend: KafkaBackend) -> list[int]:
    """Every num_waiting the worker reports to this backend, in order (observed, not changed)."""
    seen: list[int] = []
    dispatcher = backend.dispatcher
    original = dispatcher.report

    def report(worker, capacity: WorkerCapacity) -> None:
        seen.append(capacity.num_waiting)
        original(worker, capacity)

    dispatcher.report = report  # type: ignore[method-assign]
    return seen


async def test_interactive_overtakes_a_batch_backlog_through_shared_slots(
        bootstrap_servers: str, demo_model_dir: Path, worker_port: int, worker, prefix: str) -> None:
    settings = make_settings(
        bootstrap_servers, demo_model_dir,
        dispatch=DispatchSettings(max_worker_waiting=2, heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0,
                                  local_workers=0),
        shared=SharedSettings(url=REDIS_URL, prefix=prefix, lease_s=5.0))
    backend = KafkaBackend(settings, worker_port=worker_port)
    await backend.start()
    redis = Redis.from_url(REDIS_URL)
    try:
        await wait_for(lambda: "sw1" in backend.dispatcher.workers, 120, "the worker to register")
        waiting = watch_waiting(backend)
        # Long batch jobs (they are aborted at the end): none may finish while the queue is checked.
        # With 120 tokens the CPU decode kernel ended one within the second below, and between a
        # waiting job starting and the next one sent the store counted 1 (CI saw that once).
        batch = [await submit(backend, request(f"bulk{i % 2}", Priority.BATCH, 2000)) for i in range(7)]
        started: set[str] = set()
        finished: dict[str, FinishReason] = {}

        async def follow(sub) -> list[RequestDelta]:
            deltas = []
            async for delta in sub:
                deltas.append(delta)
                if delta.token_ids:
                    started.add(sub.request_id)
                if delta.finish_reason is not None:
                    finished[sub.request_id] = delta.finish_reason
            return deltas

        followers = [asyncio.create_task(follow(s)) for s in batch]
        await wait_for(lambda: len(started) >= 2, 60, "batch work to start")
        await asyncio.sleep(1.0)  # the worker's queue is full: nothing more goes out
        assert max(waiting) <= 2  # batch work alone never passes the bound
        # The store holds exactly the unstarted batch jobs of this replica: the bound, 2 (read until
        # it does, as the slot writes may still be on their way; over the bound it never goes).
        deadline = time.monotonic() + 30
        while (counts := {int(k): int(v) for k, v in (await redis.hgetall(f"{prefix}:ws:sw1")).items()}) \
                .get(int(Priority.BATCH), 0) != 2:
            assert counts.get(int(Priority.BATCH), 0) <= 2, counts
            assert time.monotonic() < deadline, f"the store never held the 2 unstarted batch jobs: {counts}"
            await asyncio.sleep(0.02)
        interactive = await submit(backend, request("chat", Priority.INTERACTIVE, 4))
        deltas = await asyncio.wait_for(follow(interactive), 60)
        assert deltas[-1].finish_reason == FinishReason.LENGTH
        ij = interactive.state
        assert ij is not None and ij.dispatch_time is not None
        later = [s for s in batch if s.dispatch_time is None or s.dispatch_time > ij.queued_at]
        assert later and all(s.dispatch_time is None or s.dispatch_time >= ij.dispatch_time for s in later)
        assert max(waiting) <= 3  # the bound, plus the one interactive request that overtook it
        for sub in batch:
            await sub.abort()
        await asyncio.wait_for(asyncio.gather(*followers), 120)
        assert len(finished) == 8
        await wait_for(lambda: backend.dispatcher.num_jobs == 0, 30, "every job to end")
        await backend.dispatcher.slots.flush()  # type: ignore[union-attr]
        assert {k: v for k, v in (await redis.hgetall(f"{prefix}:ws:sw1")).items() if int(v)} == {}
        assert await redis.hlen(f"{prefix}:slots:{backend.shared.replica}") == 0
    finally:
        await backend.stop()
        await redis.aclose()


@pytest.fixture(scope="module")
def replica_ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def linked_worker(start_worker, demo_model_dir: Path, replica_ports: tuple[int, int]):
    """One worker connected to both replicas (one engine slot, so its waiting queue fills)."""
    gateways = ",".join(f"127.0.0.1:{port}" for port in replica_ports)
    return start_worker(demo_model_dir, gateways, "mw1", "--max-num-seqs", "1")


async def test_two_replicas_keep_one_bound_and_interactive_work_overtakes_the_others_batch(
        bootstrap_servers: str, demo_model_dir: Path, replica_ports: tuple[int, int], linked_worker,
        prefix: str) -> None:
    """Two KafkaBackends sharing Redis, one worker linked to both (one engine slot),
    max_worker_waiting 1. Both replicas send batch work: the worker never reports more than one
    waiting, to either replica. Then an interactive request on replica A, which holds nothing
    unstarted, goes out while a batch job of replica B waits unstarted at the worker (A alone
    would see a full queue and wait for it to start): it overtakes B's backlog."""
    shared = SharedSettings(url=REDIS_URL, prefix=prefix, lease_s=5.0)
    dispatch = DispatchSettings(max_worker_waiting=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0,
                                local_workers=0)
    a, b = (KafkaBackend(make_settings(bootstrap_servers, demo_model_dir, dispatch=dispatch, shared=shared),
                         worker_port=port) for port in replica_ports)
    await a.start()
    await b.start()
    try:
        await wait_for(lambda: "mw1" in a.dispatcher.workers and "mw1" in b.dispatcher.workers, 120,
                       "the worker to register with both replicas")
        seen_a, seen_b = watch_waiting(a), watch_waiting(b)
        first_token: dict[str, float] = {}
        produced: dict[str, int] = {}
        finished: set[str] = set()

        async def follow(sub) -> None:
            async for delta in sub:
                produced[sub.request_id] = produced.get(sub.request_id, 0) + len(delta.token_ids)
                if delta.token_ids and sub.request_id not in first_token:
                    first_token[sub.request_id] = time.time()
                if delta.finish_reason is not None:
                    finished.add(sub.request_id)

        from_a = [await submit(a, request("alpha", Priority.BATCH, 40)) for _ in range(3)]
        # B's jobs run long, so one of them waits unstarted for a good while behind the one
        # running (the interactive request goes out while that one has most of its tokens to go).
        from_b = [await submit(b, request(f"bulk{i % 2}", Priority.BATCH, 160)) for i in range(8)]
        followers = [asyncio.create_task(follow(s)) for s in from_a + from_b]
        await wait_for(lambda: all(s.request_id in finished for s in from_a), 180, "replica A's batch work")
        assert seen_a and seen_b and max(seen_a + seen_b) <= 1  # batch work of two replicas: one bound

        def b_job_waiting() -> bool:
            running_early = any(0 < produced.get(s.request_id, 0) < 40 and s.request_id not in finished
                                for s in from_b)  # >= 120 of its 160 tokens to go
            return running_early and any(s.dispatch_time is not None and s.request_id not in first_token
                                         for s in from_b)

        await wait_for(b_job_waiting, 120, "a batch job of B's sent and not started behind one just started")
        interactive = await submit(a, request("chat", Priority.INTERACTIVE, 4))
        await follow(interactive)
        sent = interactive.dispatch_time
        assert sent is not None
        # A batch job of B's had been sent and had not started when the interactive one went out.
        assert any(s.dispatch_time is not None and s.dispatch_time < sent < first_token.get(s.request_id, 1e18)
                   for s in from_b), (sent, [(s.dispatch_time, first_token.get(s.request_id)) for s in from_b])
        assert any(s.request_id not in finished for s in from_b)  # served before B's backlog ended
        # The bound plus the one request that overtook it (the engine preempted batch work for it).
        assert max(seen_a + seen_b) <= 2
        for sub in from_b:
            await sub.abort()
        await asyncio.wait_for(asyncio.gather(*followers), 120)
    finally:
        await a.stop()
        await b.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """A redis-server of this test's own (no persistence) on a fixed free port: it can be killed
    and started again there, as an outage would, without touching the Redis other tests share."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian's redis-server package)")
    port = free_port()
    running: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        running.append(process)
        return process

    start.port = port  # type: ignore[attr-defined]
    yield start
    for process in running:
        if process.poll() is None:
            process.kill()
            process.wait(10)


async def test_dispatch_fails_closed_while_redis_is_down_and_resumes_when_it_is_back(
        bootstrap_servers: str, demo_model_dir: Path, worker_port: int, worker, own_redis) -> None:
    redis_process = own_redis()
    url = f"redis://127.0.0.1:{own_redis.port}/0"
    client = Redis.from_url(url)
    await wait_until_answers(client)
    settings = make_settings(bootstrap_servers, demo_model_dir, shared=SharedSettings(url=url, lease_s=5.0))
    backend = KafkaBackend(settings, worker_port=worker_port)
    await backend.start()
    try:
        await wait_for(lambda: "sw1" in backend.dispatcher.workers, 120, "the worker to register")
        first = await submit(backend, request("t", Priority.STANDARD, 4))
        assert [d async for d in first][-1].finish_reason == FinishReason.LENGTH
        redis_process.kill()
        redis_process.wait(10)
        during = await submit(backend, request("t", Priority.STANDARD, 4))  # accepted: Kafka has it
        await asyncio.sleep(2 * SLOT_ERROR_RETRY_S + 1.0)  # several takes tried and failed meanwhile
        assert during.dispatch_time is None  # no slot, so never sent
        own_redis()  # back, empty
        deltas = await asyncio.wait_for(_all(during), 60)
        assert deltas[-1].finish_reason == FinishReason.LENGTH
    finally:
        await backend.stop()
        await client.aclose()


async def _all(sub) -> list[RequestDelta]:
    return [delta async for delta in sub]


async def wait_until_answers(client: Redis) -> None:
    for _ in range(100):
        try:
            await client.ping()
            return
        except (OSError, RedisError):
            await asyncio.sleep(0.05)
    raise AssertionError("the test's redis-server never answered")
