"""Cache-aware routing with real worker processes (docs/routing.md): KV events reach the gateway's
index, a request lands on the worker holding its prefix, a hot prefix spreads once its worker is
loaded, a job waits for room where its prefix is while another tenant's takes the free worker, a
restarted worker is treated as empty, tenant salts keep equal prompts apart, two gateway
replicas route a conversation's next turn to the same worker, and a frame the gateway cannot use
(an unknown kind, a malformed event) is logged and skipped without dropping the worker.

The last needs a peer that sends bad frames: no real worker does, so that test speaks the worker
protocol itself over a real socket to a real gateway (a fault we cannot provoke otherwise).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from sluice_testing import drain, submit

from sluice.broker import free_port
from sluice.gateway.dispatch import routing
from sluice.gateway.queueing.acceptance import KafkaBackend
from sluice.prefix_hash import prefix_block_hashes
from sluice.protocol import (
    FinishReason,
    FrameDecoder,
    GenerateRequest,
    KvEvents,
    Priority,
    RequestDelta,
    SamplingParams,
    ServedModelInfo,
    WorkerCapacity,
    WorkerChallenge,
    WorkerRegister,
    encode_frame,
    read_opening,
    worker_proof,
)
from sluice.settings import DispatchSettings, RoutingSettings

from .conftest import WORKER_SECRET, StartWorker, kill_group, make_settings, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_ids = itertools.count()
SYSTEM = tuple(range(100, 260))  # a 160-token "system prompt": 10 blocks of 16


def request(prompt: tuple[int, ...], tenant: str = "t1", max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"route-{next(_ids)}-{time.monotonic_ns()}", tenant_id=tenant, model="demo",
        priority=Priority.STANDARD, prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt=f"salt-{tenant}", arrival_time=time.time())


def tokens(deltas: list[RequestDelta]) -> tuple[int, ...]:
    return tuple(t for d in deltas for t in d.token_ids)


async def gateway(bootstrap_servers: str, model_dir: Path, port: int, *, max_worker_waiting: int = 8,
                  **routing: object) -> KafkaBackend:
    settings = make_settings(
        bootstrap_servers, model_dir,
        routing=RoutingSettings(policy="cache_aware", **routing),  # type: ignore[arg-type]
        dispatch=DispatchSettings(max_worker_waiting=max_worker_waiting, heartbeat_interval_s=0.5,
                                  heartbeat_timeout_s=5.0, local_workers=0))
    backend = KafkaBackend(settings, worker_port=port)
    await backend.start()
    return backend


@pytest.fixture
async def backend(bootstrap_servers: str, demo_model_dir: Path) -> AsyncIterator[KafkaBackend]:
    # The share guard out of the way (balance_margin 100): these tests send a conversation's turns
    # back to back, which it may rightly spread (tests/unit/dispatch/test_routing.py covers it).
    gw = await gateway(bootstrap_servers, demo_model_dir, free_port(), load_cost_tokens=0, balance_margin=100.0)
    try:
        yield gw
    finally:
        await gw.stop()


def start_two(start_worker: StartWorker, model_dir: Path, gateways: str, prefix: str) -> list[str]:
    ids = [f"{prefix}-a", f"{prefix}-b"]
    for worker_id in ids:
        start_worker(model_dir, gateways, worker_id, "--max-num-seqs", "4")
    return ids


def holds(backend: KafkaBackend, worker_id: str, prompt: tuple[int, ...], salt: str) -> int:
    """Blocks of `prompt` the gateway's index says `worker_id` holds."""
    worker = backend.dispatcher.workers.get(worker_id)
    if worker is None or not worker.cache.block_size:
        return 0
    return worker.cache.matched_blocks(prefix_block_hashes(salt, prompt, worker.cache.block_size))


async def test_requests_follow_their_cached_prefix_and_tenants_stay_apart(
        backend: KafkaBackend, demo_model_dir: Path, start_worker: StartWorker) -> None:
    ids = start_two(start_worker, demo_model_dir, f"127.0.0.1:{backend.worker_port}", "follow")
    await wait_for(lambda: all(w in backend.dispatcher.workers for w in ids), 180, "both workers")

    first = await submit(backend, request((*SYSTEM, 7, 8, 9)))
    await drain(first)
    home = first.state.worker
    other = next(w for w in ids if w != home)
    # The engine's KV events reached the index (not only what the gateway sent).
    await wait_for(lambda: backend.dispatcher.workers[home].cache.num_events > 0, 30, "KV events")
    assert holds(backend, home, (*SYSTEM, 7), "salt-t1") == 10
    assert holds(backend, other, (*SYSTEM, 7), "salt-t1") == 0

    # Later turns of t1, extending the prompt, go home and hit the engine's cache there.
    for extra in ((1, 2, 3), (4, 5, 6, 7, 8)):
        turn = await submit(backend, request(SYSTEM + extra))
        await drain(turn)
        assert turn.state.worker == home
        assert turn.state.route == "cache" and turn.state.route_cached_tokens == 160
        assert turn.state.cached_tokens >= 160  # the engine found them where routing predicted

    # The same prompt from another tenant (another salt) is not routed as if it were cached.
    stranger = await submit(backend, request((*SYSTEM, 1, 2, 3), tenant="t2"))
    await drain(stranger)
    assert stranger.state.route_cached_tokens == 0 and stranger.state.route != "cache"
    assert stranger.state.cached_tokens == 0

    view = {v["worker_id"]: v for v in backend.dispatcher.workers_view()}
    assert view[home]["cached_prompt_tokens"] >= 320 and view[home]["cache_hit_rate"] > 0
    assert view[home]["cache_index_blocks"] >= 10


async def test_a_hot_prefix_spreads_once_its_worker_is_loaded(
        backend: KafkaBackend, demo_model_dir: Path, start_worker: StartWorker) -> None:
    ids = start_two(start_worker, demo_model_dir, f"127.0.0.1:{backend.worker_port}", "hot")
    await wait_for(lambda: all(w in backend.dispatcher.workers for w in ids), 180, "both workers")
    # load_cost_tokens = 0: the cache alone would pile everything on one worker; the guard
    # (spread_margin 0.5: two more requests per 4 slots than the least loaded) must spread them.
    hot = [await submit(backend, request((*SYSTEM, i), max_tokens=64)) for i in range(8)]
    for followed in hot:
        out = await drain(followed)
        assert out[-1].finish_reason == FinishReason.LENGTH
    workers = [f.state.worker for f in hot]
    assert set(workers) == set(ids), workers
    assert any(f.state.route == "spread" for f in hot), [f.state.route for f in hot]
    assert max(workers.count(w) for w in ids) <= 5


async def test_a_job_waits_for_room_where_its_prefix_is_while_another_tenant_takes_the_free_worker(
        bootstrap_servers: str, demo_model_dir: Path, start_worker: StartWorker,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Saturation (one slot and one waiting place per worker): t1's next turn is held for the full
    worker holding its prefix rather than prefilled on the free one, and t2's job, behind it in
    line, takes the free worker meanwhile; t1 then runs at home on its cache."""
    monkeypatch.setattr(routing, "LOCALITY_WAIT_S", 120.0)  # the hold's time limit out of the way
    # No load in the cost and no spread or share guard: home stays first-ranked for t1 however full it is.
    gw = await gateway(bootstrap_servers, demo_model_dir, free_port(), max_worker_waiting=1,
                       load_cost_tokens=0, spread_margin=10.0, balance_margin=100.0)
    try:
        ids = [f"hold-{x}" for x in "ab"]
        for worker_id in ids:
            start_worker(demo_model_dir, f"127.0.0.1:{gw.worker_port}", worker_id, "--max-num-seqs", "1")
        await wait_for(lambda: all(w in gw.dispatcher.workers for w in ids), 180, "both workers")
        context = tuple(range(100, 420))  # 320 tokens: more than LOCALITY_MIN_TOKENS
        first = await submit(gw, request((*context, 1)))
        await drain(first)
        home = first.state.worker
        other = next(w for w in ids if w != home)
        await wait_for(lambda: holds(gw, home, (*context, 1), "salt-t1") == 20, 30, "the prefix indexed")
        # t1's own long requests fill home: one running, one waiting.
        busy = [await submit(gw, request((*context, 2, i), max_tokens=400)) for i in range(2)]
        await wait_for(lambda: all(b.state.worker == home for b in busy), 30, "home full")
        turn = await submit(gw, request((*context, 3)))
        stranger = await submit(gw, request(tuple(range(300, 460)), tenant="t2"))
        await wait_for(lambda: stranger.state.worker != "", 30, "t2 dispatched")
        assert stranger.state.worker == other
        assert turn.state.worker == "", "t1's turn went to the worker without its prefix"
        for followed in (*busy, turn, stranger):
            await drain(followed)
        assert turn.state.worker == home and turn.state.route == "cache"
        assert turn.state.cached_tokens >= 320
    finally:
        await gw.stop()


async def test_a_restarted_worker_is_treated_as_empty(
        backend: KafkaBackend, demo_model_dir: Path, start_worker: StartWorker) -> None:
    port = backend.worker_port
    process = start_worker(demo_model_dir, port, "restart-a", "--max-num-seqs", "4")
    await wait_for(lambda: "restart-a" in backend.dispatcher.workers, 180, "the worker")
    await drain(await submit(backend, request((*SYSTEM, 1))))
    await wait_for(lambda: holds(backend, "restart-a", (*SYSTEM, 1), "salt-t1") == 10, 30, "the prefix indexed")

    kill_group(process)
    await wait_for(lambda: "restart-a" not in backend.dispatcher.workers, 30, "the worker to be dropped")
    start_worker(demo_model_dir, port, "restart-a", "--max-num-seqs", "4")
    await wait_for(lambda: "restart-a" in backend.dispatcher.workers, 180, "the restarted worker")
    assert len(backend.dispatcher.workers["restart-a"].cache) == 0
    again = await submit(backend, request((*SYSTEM, 2)))
    await drain(again)
    assert again.state.route_cached_tokens == 0 and again.state.cached_tokens == 0


async def test_two_replicas_route_the_next_turn_to_the_same_worker(
        bootstrap_servers: str, demo_model_dir: Path, start_worker: StartWorker) -> None:
    replicas = [await gateway(bootstrap_servers, demo_model_dir, free_port()) for _ in range(2)]
    try:
        addresses = ",".join(f"127.0.0.1:{r.worker_port}" for r in replicas)
        ids = start_two(start_worker, demo_model_dir, addresses, "replicas")
        await wait_for(lambda: all(w in r.dispatcher.workers for r in replicas for w in ids), 180,
                       "both workers on both replicas")
        a, b = replicas
        turn1 = await submit(a, request((*SYSTEM, 11, 12)))
        out1 = await drain(turn1)
        home = turn1.state.worker
        conversation = (*SYSTEM, 11, 12, *tokens(out1), 13, 14, 15)
        # Each replica indexes the same worker's events on its own link.
        await wait_for(lambda: all(holds(r, home, conversation, "salt-t1") >= 10 for r in replicas), 30,
                       "both replicas to index the first turn")
        # ... and to have heard that the first turn ended there (each replica's own link reports it).
        await wait_for(lambda: all(r.dispatcher.workers[w].capacity.num_running == 0 for r in replicas for w in ids),
                       30, "both workers idle on both replicas")
        turn2 = await submit(b, request(conversation))
        await drain(turn2)
        views = {v["worker_id"]: (v["load"], v["free_kv_blocks"], v["total_kv_blocks"])
                 for v in b.dispatcher.workers_view()}
        assert turn2.state.worker == home and turn2.state.route == "cache", (
            turn2.state.route, turn2.state.route_cached_tokens, views)
        assert turn2.state.cached_tokens >= 160
    finally:
        for replica in replicas:
            await replica.stop()


async def test_unknown_and_malformed_frames_are_logged_and_skipped(
        backend: KafkaBackend, caplog: pytest.LogCaptureFixture) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", backend.worker_port)
    decoder = FrameDecoder()
    challenge = (await read_opening(reader, decoder))[0]
    assert isinstance(challenge, WorkerChallenge) and challenge.kv_events
    capacity = WorkerCapacity(worker_id="raw", num_running=0, num_waiting=0, free_kv_blocks=64, total_kv_blocks=64,
                              max_num_seqs=4, sent_at=time.time())
    register = WorkerRegister(worker_id="raw", models=(ServedModelInfo(name="demo", max_model_len=1 << 20),),
                              device="cpu", pid=os.getpid(), capacity=capacity,
                              proof=worker_proof(WORKER_SECRET, challenge.nonce, "raw"))
    writer.write(encode_frame(register))
    await wait_for(lambda: "raw" in backend.dispatcher.workers, 30, "the raw peer to register")
    with caplog.at_level(logging.WARNING):
        body = msgspec.msgpack.encode({"type": "kv_events_v9", "anything": [1, 2]})  # a newer worker's kind
        writer.write(len(body).to_bytes(4, "big") + body)
        writer.write(encode_frame(KvEvents(block_size=16, stored=(b"short",))))  # a hash of the wrong size
        writer.write(encode_frame(KvEvents(block_size=16, stored=(bytes(16),))))  # fine
        writer.write(encode_frame(msgspec.structs.replace(capacity, num_waiting=1)))
        await writer.drain()
        link = backend.dispatcher.workers["raw"]
        await wait_for(lambda: link.capacity.num_waiting == 1, 30, "the frames after the bad ones")
    assert backend.dispatcher.workers.get("raw") is link  # still connected
    assert link.cache.num_rejected == 1 and bytes(16) in link.cache
    assert any("undecodable frame" in r.message for r in caplog.records)
    assert any("malformed KV event" in r.message for r in caplog.records)
    writer.close()
