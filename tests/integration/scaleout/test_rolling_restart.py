"""Draining a replica on SIGTERM, and a rolling restart of `sluice serve --replicas 2 --workers 1`
(issue #16, acceptance (e)): the cluster runs as an operator starts it, one `sluice serve` process
with its replica and worker children, on the session's broker, a fresh PostgreSQL database and a
fresh Redis key prefix (fixtures of conftest.py).

- A replica sent SIGTERM answers new POSTs with 503 `replica_draining` (and Retry-After), reports
  `draining` on /health, lets its open stream end with the full greedy text, exits 0, and the
  supervisor starts it again at once (a drained exit is no crash).
- SIGHUP to `sluice serve` restarts every replica, one at a time, while 50 clients
  (`sluice.client.stream_chat` over both replicas) stream without pause: no request fails and every
  text equals the undisturbed greedy answer to its prompt.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sluice.broker import free_ports
from sluice.client import stream_chat

from .conftest import REDIS_URL

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN_TOKEN = "rolling-restart-admin-" + "r" * 24
CLIENTS = 50
PROMPTS = [f"Tell me about rolling restart number {i}." for i in range(5)]
MAX_TOKENS = 24
LONG_TOKENS = 2000  # the stream open through a drain
SLUICE_TOML = (
    "[dispatch]\nlocal_workers = 1\nheartbeat_interval_s = 0.5\nheartbeat_timeout_s = 5.0\n"
    "[engine]\nmax_num_seqs = 16\nmax_num_batched_tokens = 512\n"
    # Long enough for every open stream of this test to end on the busy machine: the test is that
    # a drain loses nothing, not how fast it is.
    "[gateway]\ndrain_timeout_s = 120\n"
    "[kafka]\nsession_timeout_ms = 3000\nheartbeat_interval_ms = 1000\n"
)
TENANTS_TOML = '[[tenants]]\nname = "rolling"\npriority_ceiling = "interactive"\n'


@dataclass
class ServeCluster:
    process: subprocess.Popen[bytes]
    cwd: Path
    log_path: Path
    bases: list[str]

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def replica_log(self, index: int) -> str:
        return (self.cwd / "var" / "logs" / f"replica-{index}.log").read_text(errors="replace")

    def replica_pid(self, index: int) -> int:
        port = self.bases[index].rpartition(":")[2]
        out = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout
        for pid in (int(p) for p in out.split()):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                cmd = Path(f"/proc/{pid}/cmdline").read_text()
                if "gateway\0--host" in cmd and f"--port\0{port}\0" in cmd:
                    return pid
        raise AssertionError(f"no replica process on port {port}")


def _ready(base: str) -> bool:
    try:
        return httpx.get(base + "/ready", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(predicate, what: str, timeout: float = 240.0, cluster: ServeCluster | None = None):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if cluster is not None:
            assert cluster.process.poll() is None, f"sluice serve exited:\n{cluster.output()}"
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{cluster.output()}" if cluster else ""))


@pytest.fixture(scope="module")
def serve_cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, bootstrap_servers: str,
                  postgres_database: str, shared_prefix: str) -> Iterator[ServeCluster]:
    cwd = tmp_path_factory.mktemp("rolling")
    config = cwd / "config"
    config.mkdir()
    (config / "sluice.toml").write_text(SLUICE_TOML)
    (config / "models.toml").write_text(f'[[models]]\nname = "demo"\npath = "{demo_model_dir}"\n')
    (config / "tenants.toml").write_text(TENANTS_TOML)
    port = free_ports(2)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3] / "src"), OMP_NUM_THREADS="1",
               SLUICE_CONFIG_DIR=str(config), SLUICE_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers,
               SLUICE_KAFKA_TOPIC_PREFIX=f"rolling{time.monotonic_ns()}", SLUICE_DATABASE_URL=postgres_database,
               SLUICE_SHARED_URL=REDIS_URL, SLUICE_SHARED_PREFIX=shared_prefix, SLUICE_SHARED_LEASE_S="2",
               SLUICE_GATEWAY_WORKER_PORT=str(free_ports(2)),  # one per replica SLUICE_GATEWAY_RECORD_LOG_PATH="",
               SLUICE_ADMIN_TOKEN=ADMIN_TOKEN, SLUICE_ADMIN_DEMO_TENANT="")
    env.pop("SLUICE_GATEWAY_WORKER_SECRET", None)  # the parent makes one for its children
    log_path = cwd / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "serve", "--port", str(port),
             "--replicas", "2", "--workers", "1"],
            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cluster = ServeCluster(process, cwd, log_path, [f"http://127.0.0.1:{port + i}" for i in range(2)])
    try:
        for base in cluster.bases:
            wait_for(lambda base=base: _ready(base), f"{base} to be ready", cluster=cluster)
        yield cluster
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


@pytest.fixture(scope="module")
def api_key(serve_cluster: ServeCluster) -> str:
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    base = serve_cluster.bases[0]
    tenants = httpx.get(base + "/admin/tenants", headers=headers, timeout=30).json()
    tenant_id = next(t["id"] for t in (tenants["data"] if isinstance(tenants, dict) else tenants)
                     if t["name"] == "rolling")
    return str(httpx.post(f"{base}/admin/tenants/{tenant_id}/keys", headers=headers, json={"name": "t"},
                          timeout=30).json()["key"])


def body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {"model": "demo", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}]}


def text_of(bases: list[str], key: str, request: dict[str, object]) -> str:
    """The streamed text, through `stream_chat` (resuming on the other replica when cut)."""
    parts: list[str] = []
    for event in stream_chat(bases, key, request, timeout_s=120):
        assert not event.is_error, event.data
        for choice in event.data.get("choices", []):
            parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


@pytest.fixture(scope="module")
def references(serve_cluster: ServeCluster, api_key: str) -> dict[str, str]:
    """Each prompt's greedy text, streamed one at a time on the undisturbed cluster (the engine's
    equality with HF greedy is the exactness tests'); both replicas answer the same."""
    refs = {p: text_of(serve_cluster.bases[:1], api_key, body(p)) for p in PROMPTS}
    assert text_of(serve_cluster.bases[1:], api_key, body(PROMPTS[0])) == refs[PROMPTS[0]]
    assert all(refs.values())
    return refs


@pytest.mark.timeout(900)  # a cluster of 4 processes starts, replicas restart: slow on 2 shared cores
def test_sigterm_drains_a_replica_and_the_supervisor_starts_it_again(
        serve_cluster: ServeCluster, api_key: str, references: dict[str, str]) -> None:
    cluster, base = serve_cluster, serve_cluster.bases[1]
    victim = cluster.replica_pid(1)
    # Long enough (seconds of decoding) that the stream is still open through the checks below on a
    # busy machine; with 400 tokens it once ended first, and the drained replica refused connections.
    long_body = body(PROMPTS[1], max_tokens=LONG_TOKENS)
    reference: list[str] = []  # from the other replica, decoded beside the stream (greedy: the same text)
    beside = threading.Thread(target=lambda: reference.append(text_of([cluster.bases[0]], api_key, long_body)))
    beside.start()
    result: dict[str, object] = {}
    started = threading.Event()

    def stream() -> None:
        parts = []
        try:  # this replica only: nothing to resume elsewhere
            for event in stream_chat([base], api_key, long_body, timeout_s=120):
                started.set()
                assert not event.is_error, event.data
                parts += [c.get("delta", {}).get("content") or "" for c in event.data.get("choices", [])]
            result["text"] = "".join(parts)
        except Exception as exc:  # reported by the assertion below
            result["error"] = exc
        finally:
            started.set()

    client = threading.Thread(target=stream)
    client.start()
    assert started.wait(120)
    os.kill(victim, signal.SIGTERM)
    health = wait_for(lambda: (r := _get(base + "/health")) is not None and r.status_code == 503 and r,
                      "/health to report draining", timeout=30)
    assert health.json() == {"status": "draining"}
    ready = httpx.get(base + "/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["checks"]["accepting"] is False
    refused = httpx.post(base + "/v1/chat/completions", json={**body(PROMPTS[0]), "stream": True},
                         headers={"authorization": f"Bearer {api_key}"}, timeout=30)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "replica_draining"
    refused = httpx.post(base + "/v1/chat/completions", json=body(PROMPTS[0]),  # not streamed: the same
                         headers={"authorization": f"Bearer {api_key}"}, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "replica_draining"
    refused = httpx.post(base + "/v1/batches", json={"input_file_id": "file-any", "endpoint": "/v1/chat/completions",
                                                      "completion_window": "24h"},
                         headers={"authorization": f"Bearer {api_key}"}, timeout=30)  # nor a batch
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "replica_draining"
    client.join(300)
    beside.join(300)
    assert "error" not in result and [result["text"]] == reference, result  # the open stream ran to its end
    wait_for(lambda: not _alive(victim), "the drained replica to exit", timeout=180)
    log_text = cluster.replica_log(1)
    assert re.search(r"draining \(SIGTERM\): [1-9]\d* open request", log_text), log_text
    assert "drained in" in log_text and "drain timeout" not in log_text
    # Started again at once (exit code 0 is no crash: no backoff), and serves.
    wait_for(lambda: "replica 1 exited cleanly" in cluster.output(), "the supervisor to see a clean exit", 60)
    wait_for(lambda: _ready(base), "the replica to be ready again", cluster=cluster)
    assert cluster.replica_pid(1) != victim
    assert text_of([base], api_key, body(PROMPTS[2])) == references[PROMPTS[2]]


@pytest.mark.timeout(900)  # a cluster of 4 processes starts, replicas restart: slow on 2 shared cores
def test_rolling_restart_under_50_streams_loses_nothing(
        serve_cluster: ServeCluster, api_key: str, references: dict[str, str]) -> None:
    cluster = serve_cluster
    for base in cluster.bases:  # both up (after the test above, or its failure, one may be starting again)
        wait_for(lambda base=base: _ready(base), f"{base} to be ready", cluster=cluster)
    before = [cluster.replica_pid(i) for i in range(2)]
    printed = cluster.output().count("rolling restart done")
    rolled = threading.Event()
    results: list[tuple[str, str]] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        bases = cluster.bases[index % 2:] + cluster.bases[:index % 2]  # half start on each replica
        n = 0
        while not rolled.is_set() or n == 0:
            prompt = PROMPTS[(index + n) % len(PROMPTS)]
            n += 1
            try:
                text = text_of(bases, api_key, body(prompt))
            except Exception as exc:
                with lock:
                    failures.append(f"client {index}: {exc!r}")
                continue
            with lock:
                results.append((prompt, text))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(results) >= CLIENTS, "a first round of streams")
    os.kill(cluster.process.pid, signal.SIGHUP)
    rolled_at = time.monotonic()
    try:
        wait_for(lambda: cluster.output().count("rolling restart done") > printed, "the rolling restart",
                 timeout=900, cluster=cluster)
        roll_s = time.monotonic() - rolled_at
    finally:
        rolled.set()
        for thread in threads:
            thread.join(300)
    print(f"\nrolling restart of 2 replicas in {roll_s:.0f}s under {CLIENTS} streaming clients: "
          f"{len(results)} streams finished, {len(failures)} failed")
    assert "rolling restart stopped" not in cluster.output()
    after = [cluster.replica_pid(i) for i in range(2)]
    assert not set(after) & set(before)  # both replicas were restarted
    # Each replica drained, and every stream open at its drain ended there. How many were open is
    # chance: a request is open in a replica while it generates, and short demo-model generations
    # left both replicas at an instant with none in a clean run (a pass of the drain too, not a
    # loss). The drain of an open stream is the test above, with one held open on purpose.
    open_at_drain = []
    for i in range(2):
        drains = re.findall(r"draining \(SIGTERM\): (\d+) open request", cluster.replica_log(i))
        assert drains, cluster.replica_log(i)
        open_at_drain.append(int(drains[-1]))
        assert "drain timeout" not in cluster.replica_log(i)
    print(f"open requests at each replica's drain: {open_at_drain}")
    assert failures == []
    assert len(results) > 2 * CLIENTS
    wrong = [(prompt, text) for prompt, text in results if text != references[prompt]]
    assert wrong == []


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=10)
    except httpx.HTTPError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
