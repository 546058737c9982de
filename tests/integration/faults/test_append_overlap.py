"""A streaming request runs while the broker is still writing it, and is accepted only on the ack.

The broker of each test is paused with SIGSTOP (a slow broker, for real: the produce stays
unacknowledged), so the request's Kafka append cannot complete. Its job still goes to the
worker at once; the client hears nothing (no head, no token) until the append is acknowledged,
and when the append fails instead the job is aborted at the worker and the client gets a 503."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from dispatch.conftest import wait_for
from sluice_testing import Followed

from sluice.broker import EmbeddedBroker
from sluice.gateway.generation.state import RequestState
from sluice.gateway.queueing.backend import QueuedSubmission
from sluice.protocol import FinishReason, RequestDelta
from sluice.settings import KafkaSettings

from .conftest import FaultGateway, fault_settings, open_gateway

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@contextmanager
def paused(broker: EmbeddedBroker) -> Iterator[None]:
    assert broker.pid is not None
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(broker.pid, signal.SIGCONT)


def kafka(broker: EmbeddedBroker, produce_timeout_s: float) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix=f"ov{uuid.uuid4().hex[:8]}",
                         partitions=2, produce_timeout_s=produce_timeout_s)


async def the_stream(opened: list[Followed]) -> Followed:
    """The stream the gateway registered for the request (at submit, before its append). Taken
    as it is opened, not looked up in the backend's table: a short job can run to its end, and
    leave that table, between two polls (the append is still unacknowledged then)."""
    await wait_for(lambda: len(opened) == 1, 60, "the request to be submitted")
    return opened[0]


def post_meanwhile(gw: FaultGateway, body: dict[str, Any],
                   headers: dict[str, str]) -> tuple[asyncio.Task[Any], list[Followed]]:
    """The request, sent from a thread of its own: the Litestar test client blocks its caller's
    event loop until the app (running in its portal's thread) has answered; with the streams the
    backend opens from now on (its `_open_stream`, observed, not replaced)."""
    opened: list[Followed] = []
    open_stream = gw.backend._open_stream

    def observed(state: RequestState) -> QueuedSubmission:
        submission = open_stream(state)
        opened.append(Followed(submission, state))
        return submission

    gw.backend._open_stream = observed  # type: ignore[method-assign]
    call = gw.client.post("/v1/completions", json=body, headers=headers, timeout=180)
    return asyncio.create_task(asyncio.to_thread(asyncio.run, call)), opened


def queued(stream: Followed) -> list[RequestDelta]:
    """The deltas delivered to a stream that nobody has read."""
    submission = stream.submission
    assert isinstance(submission, QueuedSubmission)
    return list(submission._queued)


async def test_a_stream_runs_before_its_append_is_acknowledged_but_nothing_reaches_the_client(
        own_broker: EmbeddedBroker, demo_model_dir: Path, database_url: str, worker_port: int,
        worker: Any) -> None:
    settings = fault_settings(own_broker.bootstrap_servers, demo_model_dir, database_url,
                              kafka=kafka(own_broker, produce_timeout_s=120.0))
    async for gw in open_gateway(settings, worker_port):
        auth = {"authorization": f"Bearer {gw.sdk.api_key}"}
        body = {"model": "demo", "prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        assert (await gw.client.post("/v1/completions", json=body, headers=auth, timeout=120)).status_code == 200
        with paused(own_broker):
            answer, opened = post_meanwhile(gw, body, auth)
            stream = await the_stream(opened)
            # Dispatched and generated to the end at the worker while the record is unacknowledged.
            await wait_for(lambda s=stream, d=gw.backend.dispatcher: s.dispatch_time is not None
                           and s.request_id not in d, 120, "the job to run to its end at the worker")
            assert stream.state.worker == "fw"
            await asyncio.sleep(0.5)
            assert not answer.done()  # not accepted: not even the response head went out
        response = await asyncio.wait_for(answer, 120)
        assert response.status_code == 200, response.text
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert events[-1]["usage"]["completion_tokens"] == 8 and "data: [DONE]" in response.text
        assert gw.app.state.services.quotas.live(gw.tenant_id) == (0, 0)


async def test_a_failed_append_aborts_the_dispatched_job_and_answers_503(
        own_broker: EmbeddedBroker, demo_model_dir: Path, database_url: str, worker_port: int,
        worker: Any) -> None:
    settings = fault_settings(own_broker.bootstrap_servers, demo_model_dir, database_url,
                              kafka=kafka(own_broker, produce_timeout_s=3.0))
    async for gw in open_gateway(settings, worker_port):
        auth = {"authorization": f"Bearer {gw.sdk.api_key}"}
        # Far longer than the produce timeout on a CPU worker: still running when the append fails.
        body = {"model": "demo", "prompt": "hello", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        warm = {**body, "max_tokens": 2}
        assert (await gw.client.post("/v1/completions", json=warm, headers=auth, timeout=120)).status_code == 200
        with paused(own_broker):
            answer, opened = post_meanwhile(gw, body, auth)
            stream = await the_stream(opened)
            await wait_for(lambda s=stream: s.state.has_output, 60,
                           "the job to produce tokens at the worker")
            response = await asyncio.wait_for(answer, 120)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "service_unavailable" and error["type"] == "server_error"
        assert "kafka" not in response.text.lower() and own_broker.bootstrap_servers not in response.text
        # The job was stopped at the worker, not run to its end; nothing is held or reserved.
        await wait_for(lambda s=stream, d=gw.backend.dispatcher: s.request_id not in d, 60, "the job to end")
        deltas = queued(stream)
        assert deltas[-1].finish_reason == FinishReason.ABORT
        assert deltas[-1].num_output_tokens < 4000
        assert not gw.backend.dispatcher.workers["fw"].inflight
        assert len(gw.app.state.services.generation.flights) == 0
        assert gw.app.state.services.quotas.live(gw.tenant_id) == (0, 0)
