"""How deep a vLLM-kind upstream is fed (`UpstreamLink.est_waiting`, issue #35): its batch room
does not count as waiting, a job that starts frees room at once (not at the next /metrics
reading), and a full KV cache takes the batch room away. The link is built for real; the host
(the dispatcher) is not involved in the estimate and gets no calls here."""

from __future__ import annotations

import asyncio
import time

import pytest

from sluice.gateway.dispatch.jobs import Job
from sluice.gateway.dispatch.links.upstream import UpstreamLink
from sluice.gateway.generation.state import RequestState
from sluice.protocol import GenerateRequest, Priority, SamplingParams
from sluice.settings import Settings, UpstreamSpec

pytestmark = pytest.mark.unit


def _job(i: int, *, started: bool, sent_at: float) -> Job:
    request = GenerateRequest(request_id=f"r{i}", tenant_id="t", model="demo", priority=Priority.STANDARD,
                              prompt_token_ids=(1, 2), sampling=SamplingParams(), cache_salt="s", arrival_time=0.0)
    state = RequestState.of(request, "default")
    state.dispatch_time = sent_at
    return Job(state=state, sink=lambda _delta: None, started=started)


def _link(max_num_seqs: int) -> UpstreamLink:
    spec = UpstreamSpec(name="v", base_url="http://127.0.0.1:9", models=("demo",), kind="vllm",
                        max_num_seqs=max_num_seqs)
    return UpstreamLink(spec, host=None, settings=Settings())  # type: ignore[arg-type]


def _fill(link: UpstreamLink, *, running: int, unstarted: int, sent_at: float) -> None:
    jobs = [_job(i, started=True, sent_at=0.0) for i in range(running)]
    jobs += [_job(running + i, started=False, sent_at=sent_at) for i in range(unstarted)]
    link.inflight = {job.request_id: job for job in jobs}


def test_batch_room_is_not_waiting_and_a_start_frees_room_at_once() -> None:
    async def run() -> None:
        link = _link(max_num_seqs=8)
        link._read_at = time.time() - 5  # a reading 5 s old: every unstarted job was sent after it
        link.num_waiting = 0
        _fill(link, running=4, unstarted=6, sent_at=time.time())
        assert link.est_waiting == 2  # 6 unstarted, 4 free places in its batch of 8
        _fill(link, running=8, unstarted=6, sent_at=time.time())
        assert link.est_waiting == 6  # a full batch: all of them wait
        link.kv_usage = 0.97
        _fill(link, running=2, unstarted=6, sent_at=time.time())
        assert link.est_waiting == 6  # KV full: the free places take nothing
        link.kv_usage = 0.2
        # The reading said 5 waiting; 3 of this link's jobs started since: 2 can still be waiting.
        link.num_waiting, link._read_at = 5, time.time() + 1
        _fill(link, running=8, unstarted=2, sent_at=0.0)
        assert link.est_waiting == 2
        unknown = _link(max_num_seqs=0)  # no batch size given: the queue alone, as before
        unknown._read_at = time.time() - 5
        _fill(unknown, running=1, unstarted=3, sent_at=time.time())
        assert unknown.est_waiting == 3
        await link.shutdown()
        await unknown.shutdown()

    asyncio.run(run())
