"""Worker failover (issue #16 (b)): a worker process SIGKILLed (or SIGSTOPped) mid-stream; its
stream continues on the other worker, recomputing prompt + the tokens already delivered, and the
client sees a stall, not an error: the same text and token ids as an undisturbed greedy run, no error event, the same
finish_reason and usage. So does a request constrained by a JSON schema killed mid-object (its grammar
state is rebuilt from the resumed tokens: issue #31). A request that keeps losing its workers fails
after the bounded attempts.

Two real worker processes on this module's worker port, the whole app (OpenAI HTTP API, quotas,
Kafka backend) on the session's broker and a real database.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from dispatch.conftest import kill_group
from structured_cases import LONG_OBJECT

from sluice import telemetry
from sluice.gateway.dispatch.dispatcher import MAX_DISPATCH_ATTEMPTS
from sluice.gateway.generation.state import RequestState

from .conftest import FaultGateway, StartWorker, fault_settings, open_gateway, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORKER_IDS = ("fa", "fb")
BODY = {"model": "demo", "prompt": "The keeper writes the level", "max_tokens": 200, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
CONSTRAINED = {**BODY, "max_tokens": 480, "ignore_eos": False, "guided_json": LONG_OBJECT}
KILL_AT = 40  # tokens delivered when the worker is killed


class Fleet:
    """The module's worker processes by id; `restart` brings a killed one back under its id."""

    def __init__(self, start: Callable[[str], subprocess.Popen[bytes]]) -> None:
        self._start = start
        self.processes = {wid: start(wid) for wid in WORKER_IDS}

    def kill(self, worker_id: str) -> None:
        kill_group(self.processes[worker_id])

    def freeze(self, worker_id: str) -> None:
        """SIGSTOP: alive, connected, silent (no heartbeats, no tokens)."""
        os.killpg(self.processes[worker_id].pid, signal.SIGSTOP)

    def restart(self, worker_id: str) -> None:
        self.processes[worker_id] = self._start(worker_id)


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: failover does not touch the database (the shared fixture would run each test twice)."""
    return f"sqlite+aiosqlite:///{tmp_path / 'sluice.db'}"


@pytest.fixture(scope="module")
def fleet(start_worker: StartWorker, demo_model_dir: Path, worker_port: int) -> Fleet:
    return Fleet(lambda wid: start_worker(demo_model_dir, worker_port, wid, "--max-num-seqs", "4"))


@pytest.fixture
async def gateway(bootstrap_servers: str, demo_model_dir: Path, database_url: str, worker_port: int,
                  fleet: Fleet) -> AsyncIterator[FaultGateway]:
    settings = fault_settings(bootstrap_servers, demo_model_dir, database_url)
    async for gw in open_gateway(settings, worker_port, wait_worker=False):
        await wait_for(functools.partial(both_up, gw), 180, "both workers to register")
        yield gw


def both_up(gw: FaultGateway) -> bool:
    return all(w in gw.backend.dispatcher.workers for w in WORKER_IDS)


def the_job(gw: FaultGateway) -> RequestState | None:
    """The state of the one stream this gateway runs (None before it is accepted, and after it ended)."""
    flights = list(gw.app.state.services.generation.flights)
    return flights[0].state if flights else None


async def stream_events(gw: FaultGateway, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every SSE event of one streamed completion, decoded (the test client hands them over at the end)."""
    headers = {"authorization": f"Bearer {gw.sdk.api_key}"}
    events: list[dict[str, Any]] = []
    async with gw.client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def watch(gw: FaultGateway, jobs: list[RequestState], stop: threading.Event,
          on_poll: Callable[[RequestState], None] | None) -> None:
    """Notes the stream's state and shows it to `on_poll` every few ms. A thread: the test client runs
    the app on a loop of its own and blocks this one meanwhile."""
    while not stop.wait(0.005):
        job = the_job(gw)
        if job is not None and job not in jobs:
            jobs.append(job)
        if job is not None and on_poll is not None:
            on_poll(job)


async def run_stream(gw: FaultGateway, jobs: list[RequestState], on_poll: Callable[[RequestState], None] | None = None,
                     body: dict[str, Any] = BODY) -> list[dict[str, Any]]:
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(gw, jobs, stop, on_poll), daemon=True)
    watcher.start()
    try:
        return await asyncio.wait_for(stream_events(gw, body), 300)
    finally:
        stop.set()
        watcher.join(10)


def record_of(path: Path, request_id: str) -> telemetry.RequestRecord | None:
    """The gateway's record of one request in the record log (written in the background)."""
    if not path.is_file():
        return None
    found = [r for r in telemetry.decode_records(path.read_bytes().splitlines()) if r.request_id == request_id]
    return found[0] if found else None


def summary(events: list[dict[str, Any]]) -> tuple[str, str | None, dict[str, Any]]:
    text = "".join(c["text"] for e in events for c in e.get("choices", ()))
    finish = [c["finish_reason"] for e in events for c in e.get("choices", ()) if c.get("finish_reason")]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert len(finish) == 1 and len(usage) == 1, events[-3:]
    return text, finish[0], usage[0]


@pytest.mark.parametrize(("fault", "body"), [("sigkill", BODY), ("sigstop", BODY), ("sigkill", CONSTRAINED)],
                         ids=["sigkill", "sigstop", "sigkill-constrained"])
async def test_a_lost_workers_stream_continues_on_the_other_worker(
        gateway: FaultGateway, fleet: Fleet, tmp_path: Path, fault: str, body: dict[str, Any]) -> None:
    """sigkill: the worker dies (its connection ends); sigstop: it stops answering (dropped after
    the heartbeat timeout, 5 s here). Constrained: the answer is a JSON object, the kill lands in it."""
    gw = gateway
    jobs: list[RequestState] = []
    undisturbed = await run_stream(gw, jobs, body=body)
    [reference] = jobs
    tokens = len(reference.output_token_ids)
    assert reference.attempts == 1
    assert tokens == 200 if body is BODY else tokens > KILL_AT + 20  # long enough to be killed midway

    record_log = tmp_path / "records.jsonl"
    telemetry.configure(str(record_log))
    killed: dict[str, Any] = {}

    def kill_worker(job: RequestState) -> None:  # once, mid-generation: KILL_AT tokens delivered
        worker, delivered = job.worker, len(job.output_token_ids)
        if not killed and delivered >= KILL_AT:
            killed.update(worker=worker, at=time.time(), delivered=delivered)
            if fault == "sigkill":
                fleet.kill(worker)
            else:
                fleet.freeze(worker)

    try:
        disturbed = await run_stream(gw, jobs, kill_worker, body)
        await wait_for(lambda: record_of(record_log, jobs[-1].request_id) is not None, 30, "the request record")
    finally:
        telemetry.configure("")
    assert killed, "the stream ended before the kill"
    if fault == "sigstop":
        fleet.kill(killed["worker"])  # SIGKILL ends a stopped process too
    fleet.restart(killed["worker"])  # for the next test

    assert not any("error" in e for e in disturbed), [e for e in disturbed if "error" in e]
    assert summary(disturbed) == summary(undisturbed)  # text, finish_reason, usage
    text, finish, usage = summary(disturbed)
    assert usage["completion_tokens"] == tokens
    if body is BODY:
        assert finish == "length"
    else:  # complete and valid, as undisturbed
        assert finish == "stop"
        jsonschema.validate(json.loads(text), LONG_OBJECT)
    job = jobs[-1]
    assert job.output_token_ids == reference.output_token_ids  # the same token ids
    # It resumed on the other worker after the tokens its client had when the worker died.
    assert job.worker != killed["worker"] and job.attempts == 2
    resumed = job.request.resume_token_ids
    assert len(resumed) >= killed["delivered"] >= KILL_AT
    assert resumed == tuple(reference.output_token_ids[:len(resumed)]) and len(resumed) < tokens
    assert job.num_output_tokens == tokens
    record = record_of(record_log, job.request_id)
    assert record is not None
    assert record.completion_tokens == tokens and record.finish_reason == finish
    assert record.worker == job.worker
    assert record.first_token_time is not None and record.first_token_time < killed["at"]  # the first token ever
    assert record.engine_first_token is not None and record.engine_first_token < killed["at"]
    assert record.dispatch_time is not None and record.dispatch_time < killed["at"]
    assert record.itl_max_s is not None and record.itl_p50_s is not None and record.ttft_s is not None
    if fault == "sigstop":  # the stall is in the ITL: at least the heartbeat timeout
        assert record.itl_max_s >= gw.settings.dispatch.heartbeat_timeout_s
    print(f"failover ({fault}) after {killed['delivered']} tokens: the stall (longest ITL) "
          f"{record.itl_max_s:.2f} s, ITL p50 {record.itl_p50_s * 1000:.1f} ms, TTFT {record.ttft_s:.2f} s")


async def test_a_request_that_loses_every_worker_it_lands_on_fails_after_bounded_attempts(
        gateway: FaultGateway, fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    """Stands in for a request that crashes workers: the test SIGKILLs each worker it produces output
    on (no real request kills a worker: one that raises in the engine fails alone, test_poison.py),
    and restarts it, so the fleet stays."""
    gw = gateway
    jobs: list[RequestState] = []
    lost: list[tuple[str, int]] = []  # (worker, tokens delivered when it was killed)

    def kill_each_attempt(job: RequestState) -> None:
        worker, delivered = job.worker, len(job.output_token_ids)  # the app's thread moves on meanwhile
        if worker and job.attempts > len(lost) and delivered > (lost[-1][1] if lost else 0):
            lost.append((worker, delivered))
            fleet.kill(worker)
            fleet.restart(worker)

    events = await run_stream(gw, jobs, kill_each_attempt)
    [job] = jobs
    assert len(lost) == MAX_DISPATCH_ATTEMPTS == job.attempts
    assert "error" in events[-1] and events[-1]["error"]["code"] == "generation_failed", events[-2:]
    assert not any("error" in e for e in events[:-1])  # the first losses were stalls
    # Resumed twice: each attempt went on after what the one before had delivered.
    assert len(job.request.resume_token_ids) >= lost[-2][1]
    assert any(f"{MAX_DISPATCH_ATTEMPTS} workers serving this request were lost" in r.getMessage()
               and "not tried again" in r.getMessage() for r in caplog.records)
    # The fleet is still there: the next request is served.
    await wait_for(lambda: both_up(gw), 180, "the restarts")
    after = await gw.sdk.completions.create(model="demo", prompt="after", max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason == "length"
