"""A request that raises inside the engine ends with an error for that request alone: the worker
process keeps running and the other streams on it complete. The poison request is sent straight
to a real worker over the protocol (no gateway validation in front), beside a normal stream."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sluice_testing import drain, submit

from sluice.gateway.launch.serve import HEALTHY_RUN_S, RESTART_BACKOFF_S, restart_delay
from sluice.protocol import FinishReason, SamplingParams

from .conftest import backend_with_worker, wire_request

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_request_that_raises_in_the_engine_fails_alone(
        bootstrap_servers: str, demo_model_dir: Path, start_worker) -> None:
    async with backend_with_worker(bootstrap_servers, demo_model_dir, start_worker, "pw1",
                                   "--max-num-seqs", "4") as (backend, worker):
        pid = backend.dispatcher.workers["pw1"].pid
        normal = await submit(backend, wire_request("normal", SamplingParams(max_tokens=24, temperature=0.0,
                                                                       ignore_eos=True)))
        await asyncio.sleep(0.3)  # the normal stream is decoding when the poison arrives
        # top_k = 2**63 fits the wire format (msgpack uint64) but not the sampler's int64 tensor.
        poison = await submit(backend, wire_request("poison", SamplingParams(max_tokens=8, temperature=1.0,
                                                                       top_k=2**63, ignore_eos=True)))
        poisoned, streamed = await asyncio.wait_for(asyncio.gather(drain(poison), drain(normal)), 180)
        final = poisoned[-1]
        assert final.finish_reason == FinishReason.ERROR and final.error
        assert "Overflow" not in final.error and "Error(" not in final.error  # no internal exception text
        assert streamed[-1].finish_reason == FinishReason.LENGTH
        assert sum(len(d.token_ids) for d in streamed) == 24

        # The same worker process serves the next request, poison again included.
        again = await submit(backend, wire_request("poison2", SamplingParams(max_tokens=4, temperature=0.7,
                                                                       top_k=2**63, ignore_eos=True)))
        after = await submit(backend, wire_request("after", SamplingParams(max_tokens=6, temperature=0.0,
                                                                     ignore_eos=True)))
        results = await asyncio.wait_for(asyncio.gather(drain(again), drain(after)), 180)
        assert results[0][-1].finish_reason == FinishReason.ERROR
        assert results[1][-1].finish_reason == FinishReason.LENGTH
        assert worker.poll() is None
        assert backend.dispatcher.workers["pw1"].pid == pid


def test_restart_backoff_resets_after_a_healthy_run() -> None:
    restarts = 0
    delays = []
    for _ in range(6):  # crash loop: each run dies at once
        delay, restarts = restart_delay(restarts, uptime_s=0.5)
        delays.append(delay)
    assert delays == [*RESTART_BACKOFF_S, RESTART_BACKOFF_S[-1], RESTART_BACKOFF_S[-1]]
    delay, restarts = restart_delay(restarts, uptime_s=HEALTHY_RUN_S + 1)
    assert delay == RESTART_BACKOFF_S[0] and restarts == 1
