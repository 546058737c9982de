"""One real `sluice worker` process linked to two gateways (`--gateway a:p,b:p`), as every worker
is to every replica: each gateway gets its own requests' deltas and nothing else, greedy output is
the same as from a worker serving one gateway, a request id already running that arrives from the
other gateway is refused there (the running one is untouched), closing one gateway leaves the
other's running request to finish, and the worker reconnects to a restarted gateway.

Two KafkaBackends in this process (topics of their own on the session broker) stand for two
replicas; they share the worker secret, as replicas do.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sluice_testing import submit

from sluice.broker import free_port
from sluice.gateway.queueing.acceptance import KafkaBackend
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams

from .conftest import StartWorker, make_settings, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_ids = itertools.count()
PROMPTS = {"a": tuple(range(40, 57)), "b": tuple(range(300, 311))}
RUNNING_TOKENS = 1500  # the request whose id the other gateway sends again


def request(prompt: tuple[int, ...], max_tokens: int, request_id: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id or f"multi-{next(_ids)}-{time.monotonic_ns()}", tenant_id="t", model="demo",
        priority=Priority.STANDARD, prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt="t", arrival_time=time.time())


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def drain(sub) -> list[RequestDelta]:
    return await asyncio.wait_for(_collect(sub), 180)


async def _collect(sub) -> list[RequestDelta]:
    return [delta async for delta in sub]


async def gateway(bootstrap_servers: str, model_dir: Path, port: int) -> KafkaBackend:
    backend = KafkaBackend(make_settings(bootstrap_servers, model_dir), worker_port=port)
    await backend.start()
    return backend


@pytest.fixture
async def two_gateways(bootstrap_servers: str, demo_model_dir: Path) -> AsyncIterator[list[KafkaBackend]]:
    backends = [await gateway(bootstrap_servers, demo_model_dir, free_port()) for _ in range(2)]
    try:
        yield backends
    finally:
        for backend in backends:
            await backend.stop()


async def baseline(bootstrap_servers: str, demo_model_dir: Path, start_worker: StartWorker) -> dict[str, list[int]]:
    """The greedy tokens of each prompt from a worker that serves one gateway, one request at a time."""
    port = free_port()
    backend = await gateway(bootstrap_servers, demo_model_dir, port)
    worker = start_worker(demo_model_dir, port, "single", "--max-num-seqs", "4")
    try:
        await wait_for(lambda: "single" in backend.dispatcher.workers, 180, "the single-gateway worker")
        return {name: tokens(await drain(await submit(backend, request(prompt, 12))))
                for name, prompt in PROMPTS.items()}
    finally:
        await backend.stop()
        worker.terminate()
        worker.wait(30)


async def test_one_worker_serves_two_gateways(bootstrap_servers: str, demo_model_dir: Path,
                                              start_worker: StartWorker, two_gateways: list[KafkaBackend]) -> None:
    expected = await baseline(bootstrap_servers, demo_model_dir, start_worker)
    a, b = two_gateways
    addresses = f"127.0.0.1:{a.worker_port},127.0.0.1:{b.worker_port}"
    worker = start_worker(demo_model_dir, addresses, "multi", "--max-num-seqs", "4")
    await wait_for(lambda: "multi" in a.dispatcher.workers and "multi" in b.dispatcher.workers, 180,
                   "the worker to register with both gateways")

    # Both at once: each gateway gets its own request's tokens, the same as from a one-gateway worker.
    sub_a, sub_b = await submit(a, request(PROMPTS["a"], 12)), await submit(b, request(PROMPTS["b"], 12))
    out_a, out_b = await asyncio.gather(drain(sub_a), drain(sub_b))
    for name, out in (("a", out_a), ("b", out_b)):
        assert out[-1].finish_reason == FinishReason.LENGTH and out[-1].error is None, name
        assert tokens(out) == expected[name], name
        assert {d.request_id for d in out} == {(sub_a if name == "a" else sub_b).request_id}
    # Each link counts what it received: one request each.
    await wait_for(lambda: a.dispatcher.workers["multi"].capacity.num_received == 1
                   and b.dispatcher.workers["multi"].capacity.num_received == 1, 30, "per-link num_received")

    # An id already running, sent by the other gateway: refused on that link; the running one goes on.
    # Long enough (seconds) to be seen started by a 20 ms poll and to be running still when the other
    # gateway's copy arrives (48 tokens ended between two polls on a slow CI host).
    running = await submit(a, request(PROMPTS["a"], RUNNING_TOKENS, request_id="same-id"))
    await wait_for(lambda: "same-id" in a.dispatcher.workers["multi"].inflight
                   and a.dispatcher.workers["multi"].inflight["same-id"].started, 60, "same-id to start")
    refused = await drain(await submit(b, request(PROMPTS["b"], 4, request_id="same-id")))
    assert refused[-1].finish_reason == FinishReason.ERROR and "already running" in (refused[-1].error or "")
    kept = await drain(running)
    assert kept[-1].finish_reason == FinishReason.LENGTH and kept[-1].num_output_tokens == RUNNING_TOKENS
    assert worker.poll() is None

    # Gateway A goes away while both gateways' requests run: B's request finishes normally.
    on_a = await submit(a, request(PROMPTS["a"], 200))
    on_b = await submit(b, request(PROMPTS["b"], 40))
    await wait_for(lambda: all(rid in gw.dispatcher.workers["multi"].inflight
                               and gw.dispatcher.workers["multi"].inflight[rid].started
                               for gw, rid in ((a, on_a.request_id), (b, on_b.request_id))), 60, "both to start")
    port_a = a.worker_port
    await a.stop()
    out_b = await drain(on_b)
    assert out_b[-1].finish_reason == FinishReason.LENGTH and out_b[-1].num_output_tokens == 40
    assert tokens(out_b)[:12] == expected["b"]
    assert worker.poll() is None

    # A restarted gateway on the same port: the worker links to it again and serves it.
    restarted = await gateway(bootstrap_servers, demo_model_dir, port_a)
    two_gateways[0] = restarted
    await wait_for(lambda: "multi" in restarted.dispatcher.workers, 120, "the worker to reconnect")
    again = await drain(await submit(restarted, request(PROMPTS["a"], 12)))
    assert again[-1].finish_reason == FinishReason.LENGTH and tokens(again) == expected["a"]
    assert "multi" in b.dispatcher.workers
