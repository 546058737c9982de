"""One worker seam: the in-process link and a TCP worker go through the same engine host.

Both kinds are driven by a real Dispatcher, with a real engine (the demo model): the in-process
kind as `LocalEngineBackend` attaches it, the TCP kind as a `WorkerServer` (the worker process's
code, run on a thread here) connected to the dispatcher's worker port. Each must stream a request,
answer a request the engine refuses with an error delta, abort on cancel, report capacity with
what it received, and, when its engine fails, end every request with the same error and be lost.
An in-process link that is lost re-attaches, and its job resumes, as a worker process's would.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sluice_testing import state_of, submit

from sluice.gateway.dispatch.dispatcher import Dispatcher
from sluice.gateway.dispatch.jobs import Job
from sluice.gateway.dispatch.links.base import EngineLink
from sluice.gateway.dispatch.links.inprocess import InProcessLink
from sluice.gateway.queueing.backend import BackendUnavailable, Submission
from sluice.gateway.queueing.local import LocalEngineBackend
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams
from sluice.settings import DispatchSettings, Settings
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine
from sluice.workers.engine_host import EngineHost
from sluice.workers.server import WorkerOptions, WorkerServer

from .conftest import wait_for

pytestmark = pytest.mark.integration

KINDS = ["in-process", "tcp"]


def request(rid: str, prompt: tuple[int, ...], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, tenant_id="t", model="demo", priority=Priority.STANDARD, prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), cache_salt="t",
        arrival_time=time.time())


class Stream:
    """A job's sink: every delta, and an event set by the final one."""

    def __init__(self) -> None:
        self.deltas: list[RequestDelta] = []
        self.done = asyncio.Event()

    def __call__(self, delta: RequestDelta) -> None:
        self.deltas.append(delta)
        if delta.finish_reason is not None:
            self.done.set()

    @property
    def final(self) -> RequestDelta:
        return self.deltas[-1]

    @property
    def num_tokens(self) -> int:
        return sum(len(d.token_ids) for d in self.deltas)


@pytest.fixture(params=KINDS)
async def hosted(request: pytest.FixtureRequest, demo_model_dir: Path) -> AsyncIterator[tuple[Dispatcher, EngineHost]]:
    """A started dispatcher with one worker of the given kind, and that worker's engine host."""
    settings = Settings(dispatch=DispatchSettings(heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0))
    dispatcher = Dispatcher(settings, lambda job, final: None)
    await dispatcher.start(host="127.0.0.1", port=0)
    config = EngineConfig(model=str(demo_model_dir), max_num_seqs=4, kv_cache_bytes=8 * 2**20)
    engine = await asyncio.to_thread(LLMEngine, config)
    thread: threading.Thread | None = None
    if request.param == "in-process":
        host = EngineHost(engine, "w", heartbeat_interval_s=0.5)
        host.start_thread("engine-test")
        InProcessLink(host, "demo", dispatcher).connect()
    else:
        server = WorkerServer(engine, WorkerOptions(
            gateways=(("127.0.0.1", dispatcher.port),), worker_id="w", model_name="demo",
            heartbeat_interval_s=0.5, secret=dispatcher.worker_port.worker_secret))
        host = server.host
        thread = threading.Thread(target=lambda: _serve(server), name="worker-test", daemon=True)
        thread.start()
    try:
        await wait_for(lambda: "w" in dispatcher.workers, 120, "the worker to attach")
        yield dispatcher, host
    finally:
        await dispatcher.stop()
        host.stop()
        host.join(10)
        if thread is not None:
            thread.join(10)


def _serve(server: WorkerServer) -> None:
    with contextlib.suppress(RuntimeError):  # the engine failure the test provokes
        server.serve_forever()


def enqueue(dispatcher: Dispatcher, req: GenerateRequest) -> Stream:
    stream = Stream()
    dispatcher.enqueue(Job(state=state_of(req), sink=stream))
    return stream


async def test_both_kinds_stream_refuse_abort_and_report(hosted: tuple[Dispatcher, EngineHost]) -> None:
    dispatcher, _ = hosted
    ok = enqueue(dispatcher, request("ok", (5, 6, 7), 5))
    refused = enqueue(dispatcher, request("bad", (10**6,), 5))  # out of the vocabulary: the engine refuses
    await asyncio.wait_for(asyncio.gather(ok.done.wait(), refused.done.wait()), 120)
    assert ok.final.finish_reason is FinishReason.LENGTH and ok.num_tokens == 5
    assert refused.final.finish_reason is FinishReason.ERROR
    assert refused.final.error is not None and "prompt token ids must be between" in refused.final.error

    long = enqueue(dispatcher, request("long", (5, 6, 7), 2000))
    await wait_for(lambda: long.num_tokens >= 2, 60, "the long request to stream")
    dispatcher.cancel("long")
    await asyncio.wait_for(long.done.wait(), 60)
    assert long.final.finish_reason is FinishReason.ABORT and long.final.num_output_tokens < 2000

    # The host counts what it received from this link: the dispatcher's waiting estimate settles at 0.
    worker = dispatcher.workers["w"]
    assert isinstance(worker, EngineLink)
    await wait_for(lambda: worker.capacity.num_received == 3, 60, "a capacity report of 3 received")
    assert worker.est_waiting == 0 and dispatcher.num_jobs == 0


async def test_both_kinds_fail_every_request_when_the_engine_fails(hosted: tuple[Dispatcher, EngineHost]) -> None:
    dispatcher, host = hosted
    streams = [enqueue(dispatcher, request(f"r{i}", (5, 6, 7 + i), 2000)) for i in range(2)]
    await wait_for(lambda: all(s.num_tokens >= 1 for s in streams), 60, "both requests to stream")

    def broken_step() -> list[RequestDelta]:
        raise RuntimeError("device lost")

    # Fault injection: the engine itself failing (a lost device) cannot be provoked from a request
    # (a request that raises alone is failed alone, tests/integration/dispatch/test_poison.py).
    host.engine.step = broken_step
    await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in streams)), 60)
    for stream in streams:
        assert stream.final.finish_reason is FinishReason.ERROR
        assert stream.final.error == "the worker serving this request (w) failed; please retry"
    await wait_for(lambda: "w" not in dispatcher.workers, 60, "the failed worker to be lost")
    assert dispatcher.num_jobs == 0


async def test_a_lost_in_process_link_reattaches_and_its_job_resumes(demo_model_dir: Path) -> None:
    """Worker failover through the in-process kind: the job goes on from its delivered tokens on
    the link attached anew, with the output of an undisturbed run."""
    backend = LocalEngineBackend({"demo": demo_model_dir}, {"max_num_seqs": 4, "kv_cache_bytes": 8 * 2**20})
    await backend.start()
    try:
        assert backend.dispatcher is not None
        dispatcher = backend.dispatcher
        reference = [d async for d in await submit(backend, request("ref", (5, 6, 7), 40))]
        cut = await submit(backend, request("cut", (5, 6, 7), 40))
        deltas: list[RequestDelta] = []
        lost = None
        async for delta in cut:
            deltas.append(delta)
            if lost is None and sum(len(d.token_ids) for d in deltas) >= 5:
                lost = dispatcher.workers["local-demo"]
                # The monitor's decision on missed heartbeats, taken directly: starving the event
                # loop past the heartbeat timeout would take a fixed wait.
                dispatcher.lose(lost, "stopped sending heartbeats")
        relinked = dispatcher.workers["local-demo"]
        assert lost is not None and relinked is not lost
        assert isinstance(relinked, EngineLink) and relinked.sent == 1  # the resumed job, sent again
        assert deltas[-1].finish_reason is FinishReason.LENGTH and deltas[-1].num_output_tokens == 40
        assert [t for d in deltas for t in d.token_ids] == [t for d in reference for t in d.token_ids]
    finally:
        await backend.stop()


async def test_jobs_queued_for_a_failed_in_process_engine_fail_at_once(demo_model_dir: Path) -> None:
    """Its engine failed: the jobs still queued at the dispatcher for its model end with an error
    at once (no worker will ever serve them here), not at their deadline (600 s by default)."""
    backend = LocalEngineBackend({"demo": demo_model_dir}, {"max_num_seqs": 1, "kv_cache_bytes": 8 * 2**20})
    await backend.start()
    try:
        assert backend.dispatcher is not None
        dispatcher = backend.dispatcher
        # 1 running and max_worker_waiting (2) waiting at the engine; the rest queued here.
        flights = [await submit(backend, request(f"r{i}", (5, 6, 7 + i), 2000)) for i in range(5)]
        await wait_for(lambda: len(dispatcher.scheduler) == 2, 60, "two jobs queued at the dispatcher")
        host = backend._hosts["demo"]

        def broken_step() -> list[RequestDelta]:
            raise RuntimeError("device lost")

        # Fault injection, as above: an engine failing as a whole cannot be provoked from a request.
        host.engine.step = broken_step

        async def final(flight: Submission) -> RequestDelta:
            return [d async for d in flight][-1]

        finals = await asyncio.wait_for(asyncio.gather(*(final(f) for f in flights)), 60)
        assert all(f.finish_reason is FinishReason.ERROR for f in finals), finals
        ran = "the worker serving this request (local-demo) failed; please retry"  # at the engine
        queued_errors = [f.error for f in finals if f.error != ran]
        assert len(queued_errors) == 2, finals
        assert all(e == "the engine serving model 'demo' stopped (its engine failed); this gateway cannot serve it "
                   "until restarted" for e in queued_errors), queued_errors
        assert dispatcher.num_jobs == 0 and "local-demo" not in dispatcher.workers
        with pytest.raises(BackendUnavailable):
            await submit(backend, request("late", (5, 6, 7), 5))
    finally:
        await backend.stop()
