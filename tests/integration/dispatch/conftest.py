"""Real worker processes and a real KafkaBackend for the dispatch tests.

`start_worker` spawns `python -m sluice.cli worker` in its own process group and the fixture kills
every worker it started (group-wide, SIGKILL after a grace period), so no test leaves orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from sluice.broker import free_port
from sluice.gateway.queueing.acceptance import KafkaBackend
from sluice.protocol import GenerateRequest, Priority, SamplingParams
from sluice.settings import (
    DispatchSettings,
    GatewaySettings,
    KafkaSettings,
    ModelSpec,
    SchedulerSettings,
    Settings,
)

REPO = Path(__file__).resolve().parents[3]
# The shared worker secret of these tests: the gateway's settings and the workers' environment.
WORKER_SECRET = "dispatch-tests-worker-secret-0123456789"


def make_settings(bootstrap_servers: str, model_dir: Path, **sections: object) -> Settings:
    kafka = KafkaSettings(bootstrap_servers=bootstrap_servers, topic_prefix=f"t{uuid.uuid4().hex[:10]}",
                          partitions=2, produce_timeout_s=2.0)
    defaults: dict[str, object] = {
        "kafka": kafka,
        "gateway": GatewaySettings(worker_port=0, worker_secret=WORKER_SECRET),
        "dispatch": DispatchSettings(max_worker_waiting=2, heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0,
                                     local_workers=0),
        "scheduler": SchedulerSettings(aging_s=0.0),
        "models": (ModelSpec(name="demo", path=str(model_dir)),),
    }
    defaults.update(sections)
    return Settings(**defaults)  # type: ignore[arg-type]


def terminate_group(process: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(grace)
    except ProcessLookupError:
        pass


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL, as a crash would: no clean shutdown."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


StartWorker = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture(scope="module")
def start_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartWorker]:
    started: list[subprocess.Popen[bytes]] = []
    log_dir = tmp_path_factory.mktemp("worker-logs")

    def start(model_dir: Path, port: int | str, worker_id: str, *extra: str,
              extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`port`: the gateway's worker port on 127.0.0.1, or a whole --gateway value (str)."""
        log = open(log_dir / f"{worker_id}-{len(started)}.log", "wb")  # noqa: SIM115
        gateway = port if isinstance(port, str) else f"127.0.0.1:{port}"
        args = [sys.executable, "-m", "sluice.cli", "worker", "--model", str(model_dir),
                "--served-model-name", "demo", "--gateway", gateway, "--worker-id", worker_id,
                "--heartbeat-interval", "0.5", "--max-num-batched-tokens", "256", *extra]
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", SLUICE_GATEWAY_WORKER_SECRET=WORKER_SECRET)
        env.update(extra_env or {})
        process = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        terminate_group(process)


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 120) -> None:
    """Blocking: until `predicate()` is true, at most `timeout` s (then the test fails naming `what`)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


async def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def wire_request(name: str, sampling: SamplingParams) -> GenerateRequest:
    """A request as the gateway would send it to a worker of the demo model (no gateway checks)."""
    return GenerateRequest(
        request_id=f"{name}-{time.monotonic_ns()}", tenant_id=name, model="demo", priority=Priority.STANDARD,
        prompt_token_ids=tuple(range(5, 40)), sampling=sampling, cache_salt=name, arrival_time=time.time())


@contextlib.asynccontextmanager
async def backend_with_worker(bootstrap_servers: str, model_dir: Path, start_worker: StartWorker, worker_id: str,
                              *extra: str, extra_env: dict[str, str] | None = None,
                              ) -> AsyncIterator[tuple[KafkaBackend, subprocess.Popen[bytes]]]:
    """A Kafka backend and one worker process (`start_worker`'s flags `extra`), registered; the
    backend stops on exit (the fixture ends the worker)."""
    port = free_port()
    backend = KafkaBackend(make_settings(bootstrap_servers, model_dir), worker_port=port)
    await backend.start()
    try:
        worker = start_worker(model_dir, port, worker_id, *extra, extra_env=extra_env)
        await wait_for(lambda: worker_id in backend.dispatcher.workers, 180, "the worker to register")
        yield backend, worker
    finally:
        await backend.stop()
