"""`sluice serve` as a real process: startup output, durability across a SIGKILL, worker death,
clean shutdown, and one-line errors for bad flags. `sluice gateway` (one replica) with a worker
started apart, and `sluice serve --replicas N` (a local cluster over Redis).

The broker is the session fixture's (passed through SLUICE_KAFKA_BOOTSTRAP_SERVERS), so it
outlives a SIGKILLed gateway, as the embedded broker started by `serve` itself would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from sluice.broker import free_port, free_ports
from sluice.cli import main

from .conftest import REPO, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN_TOKEN = "slc-admin-serve-tests-" + "y" * 24


SERVE_TOML = ("[dispatch]\nlocal_workers = 1\nheartbeat_interval_s = 0.5\nheartbeat_timeout_s = 5.0\n"
              "[engine]\nmax_num_seqs = 16\nmax_num_batched_tokens = 512\n")
SERVE_TENANTS = ('[[tenants]]\nname = "demo-chat"\npriority_ceiling = "interactive"\n'
                 '[[tenants]]\nname = "nightly"\ndefault_class = "batch"\npriority_ceiling = "batch"\n')


def write_config(directory: Path, model_dir: Path, *, sluice_toml: str = SERVE_TOML,
                 tenants_toml: str = SERVE_TENANTS) -> Path:
    """A config directory serving the demo model as "demo", with these settings and tenants."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sluice.toml").write_text(sluice_toml)
    (directory / "models.toml").write_text(f'[[models]]\nname = "demo"\npath = "{model_dir}"\n')
    (directory / "tenants.toml").write_text(tenants_toml)
    return directory


class Serve:
    """One `sluice serve` (or `sluice gateway`) process group; `kill()` is SIGKILL, `stop()` is Ctrl-C."""

    def __init__(self, cwd: Path, env: dict[str, str], port: int, *extra: str, command: str = "serve") -> None:
        self.port = port
        self.log = open(cwd / f"{command}-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", command, "--port", str(port), *extra],
            cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"

    def admin(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        return httpx.request(method, self.base + path, headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                             timeout=30, **kwargs)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"serve exited with {self.process.returncode}; see {self.log.name}")
            try:
                if self.admin("GET", "/admin/workers").json().get("workers"):
                    return
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            time.sleep(0.2)
        raise AssertionError("serve did not become ready with a worker")

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.admin("GET", "/admin/workers").json()["workers"]]

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> int:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()
        return self.process.returncode


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def serve_environment(directory: Path, config_dir: Path, bootstrap_servers: str, topic_prefix: str) -> dict[str, str]:
    """The environment of a `sluice serve` under test: the session broker (topics of its own),
    SQLite under `directory`, a free worker port, no record log, the tests' admin token."""
    return dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1",
                SLUICE_CONFIG_DIR=str(config_dir),
                SLUICE_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers,
                SLUICE_KAFKA_TOPIC_PREFIX=f"{topic_prefix}{time.monotonic_ns()}",
                SLUICE_DATABASE_URL=f"sqlite+aiosqlite:///{directory / 'sluice.db'}",
                SLUICE_GATEWAY_WORKER_PORT=str(free_port()), SLUICE_GATEWAY_RECORD_LOG_PATH="",
                SLUICE_ADMIN_TOKEN=ADMIN_TOKEN)


@pytest.fixture
def serve_env(tmp_path: Path, demo_model_dir: Path, bootstrap_servers: str) -> Iterator[dict[str, str]]:
    yield serve_environment(tmp_path, write_config(tmp_path / "config", demo_model_dir), bootstrap_servers, "serve")


def batch_file(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "demo", "prompt": f"document {i}", "max_tokens": 6,
                                        "temperature": 0, "ignore_eos": True}}) + "\n"
                   for i in range(n)).encode()


def wait_batch(client: openai.OpenAI, batch_id: str, *, until_completed: int | None = None,
               timeout: float = 240) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until_completed is not None and batch.request_counts.completed >= until_completed:
            return batch
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} did not get there in time")


def custom_ids(client: openai.OpenAI, batch: openai.types.Batch) -> list[str]:
    ids: list[str] = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            ids += [json.loads(x)["custom_id"] for x in client.files.content(file_id).text.splitlines() if x]
    return ids


def test_batch_survives_gateway_sigkill_and_worker_death(tmp_path: Path, serve_env: dict[str, str]) -> None:
    port = free_port()
    first = Serve(tmp_path, serve_env, port)
    try:
        first.wait_ready()
        tenants = first.admin("GET", "/admin/tenants").json()
        tenant_id = next(t["id"] for t in (tenants["data"] if isinstance(tenants, dict) else tenants)
                         if t["name"] == "nightly")
        key = first.admin("POST", f"/admin/tenants/{tenant_id}/keys", json={"name": "t"}).json()["key"]
        client = openai.OpenAI(api_key=key, base_url=first.base + "/v1", max_retries=3)
        uploaded = client.files.create(file=("docs.jsonl", batch_file(200)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                      completion_window="24h")
        assert batch.request_counts.total == 200
        progress = wait_batch(client, batch.id, until_completed=40)
        assert progress.status == "in_progress", "the batch finished before the kill; make it longer"
        old_workers = first.worker_pids()
    finally:
        first.kill()
    second = Serve(tmp_path, serve_env, port)
    try:
        second.wait_ready()
        assert all(not alive(pid) for pid in old_workers)  # they exit with their parent
        done = wait_batch(client, batch.id)
        assert done.status == "completed"
        ids = custom_ids(client, done)
        assert len(ids) == 200 and sorted(ids) == sorted(f"line-{i}" for i in range(200))
        assert done.request_counts.completed == 200 and done.error_file_id is None

        # A worker killed mid-batch: its lines are re-queued and run on the restarted worker.
        uploaded = client.files.create(file=("more.jsonl", batch_file(80)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                      completion_window="24h")
        wait_batch(client, batch.id, until_completed=15)
        (victim,) = second.worker_pids()
        os.kill(victim, signal.SIGKILL)
        done = wait_batch(client, batch.id)
        assert done.status == "completed"
        ids = custom_ids(client, done)
        assert len(ids) == 80 and sorted(ids) == sorted(f"line-{i}" for i in range(80))
        # The restarted worker registers on its own schedule (a busy host can be between its
        # heartbeats when the batch ends): wait for it rather than read the list once.
        wait_until(second.worker_pids, "the restarted worker to register", timeout=60)
        workers = second.worker_pids()
        assert workers and victim not in workers
    finally:
        code = second.stop()
    assert code == 0
    time.sleep(1.0)
    assert all(not alive(pid) for pid in workers)


@pytest.fixture
def in_serve_env(tmp_path: Path, serve_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This test process in `serve_env` (SLUICE_* set, cwd tmp_path), for in-process `main([...])` calls."""
    for name, value in serve_env.items():
        if name.startswith("SLUICE_"):
            monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def test_serve_rejects_bad_flags_in_one_line(tmp_path: Path, in_serve_env: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "model directory" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be between" in capsys.readouterr().err
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        assert main(["serve", "--port", str(held.getsockname()[1])]) == 2
        err = capsys.readouterr().err
        assert "already in use" in err and len(err.strip().splitlines()) == 1


def _files_text(root: Path, suffixes: tuple[str, ...]) -> dict[Path, str]:
    return {p: p.read_text(errors="replace") for p in root.rglob("*") if p.is_file() and p.suffix in suffixes}


def test_demo_key_is_made_once_and_no_secret_reaches_a_log(tmp_path: Path, serve_env: dict[str, str]) -> None:
    """stdout is a log file here (not a terminal): the generated admin token and the demo key go to
    0600 files under var/, never to a log; a second start adds no key; the worker secret reaches the
    local worker through its environment, not its command line."""
    env = {k: v for k, v in serve_env.items() if k != "SLUICE_ADMIN_TOKEN"}
    port = free_port()
    seen: dict[str, str] = {}
    for start in range(2):
        serve = Serve(tmp_path, env, port)
        try:
            deadline = time.monotonic() + 180
            while not (tmp_path / "var" / "demo_key").is_file() or not serve_workers(serve, tmp_path):
                assert serve.process.poll() is None, f"serve exited; see {serve.log.name}"
                assert time.monotonic() < deadline, "serve did not become ready"
                time.sleep(0.3)
            admin_token = (tmp_path / "var" / "admin_token").read_text().strip()
            demo_key = (tmp_path / "var" / "demo_key").read_text().strip()
            for name in ("admin_token", "demo_key"):
                assert (tmp_path / "var" / name).stat().st_mode & 0o077 == 0
            if start == 0:
                seen = {"admin": admin_token, "demo": demo_key}
            else:  # nothing new was made: the same admin token and demo key, still valid
                assert (admin_token, demo_key) == (seen["admin"], seen["demo"])
            headers = {"authorization": f"Bearer {admin_token}"}
            tenants = httpx.get(serve.base + "/admin/tenants", headers=headers, timeout=30).json()
            demo = next(t for t in (tenants["data"] if isinstance(tenants, dict) else tenants)
                        if t["name"] == "demo-chat")
            keys = httpx.get(f"{serve.base}/admin/tenants/{demo['id']}/keys", headers=headers, timeout=30).json()
            keys = keys["data"] if isinstance(keys, dict) else keys
            assert len(keys) == 1 and keys[0]["expires_at"] is not None
            models = httpx.get(serve.base + "/v1/models", headers={"authorization": f"Bearer {demo_key}"}, timeout=30)
            assert models.status_code == 200
            (worker_pid,) = [w["pid"] for w in httpx.get(serve.base + "/admin/workers", headers=headers,
                                                        timeout=30).json()["workers"]]
            environ = dict(item.split("=", 1) for item in
                           Path(f"/proc/{worker_pid}/environ").read_bytes().decode().split("\0") if "=" in item)
            secret = environ["SLUICE_GATEWAY_WORKER_SECRET"]
            assert len(secret) >= 32 and "SLUICE_ADMIN_TOKEN" not in environ
            assert secret not in Path(f"/proc/{worker_pid}/cmdline").read_bytes().decode()
            seen[f"worker secret {start}"] = secret
        finally:
            assert serve.stop() == 0
    logs = _files_text(tmp_path, (".log", ".jsonl"))
    assert any("worker-" in p.name for p in logs) and any(p.name.startswith("serve-") for p in logs)
    for path, text in logs.items():
        for what, value in seen.items():
            assert value not in text, f"{what} found in {path}"
        assert not re.search(r"sk-slc-[A-Za-z0-9_-]{40}", text), path  # no whole key (a prefix may show)


def serve_workers(serve: Serve, tmp_path: Path) -> bool:
    token_file = tmp_path / "var" / "admin_token"
    if not token_file.is_file():
        return False
    try:
        view = httpx.get(serve.base + "/admin/workers", timeout=10,
                         headers={"authorization": f"Bearer {token_file.read_text().strip()}"}).json()
    except (httpx.HTTPError, ValueError):
        return False
    return bool(view.get("workers"))


def printed_line(process: Serve, pattern: str, timeout: float = 180) -> re.Match[str]:
    """The first line of a process's output that matches `pattern` (waits for it)."""
    deadline = time.monotonic() + timeout
    log = Path(process.log.name)
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"), re.MULTILINE)
        if found:
            return found
        assert process.process.poll() is None, f"exited with {process.process.returncode}:\n{log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} in {log}")


def chat(base: str, key: str) -> str:
    reply = openai.OpenAI(api_key=key, base_url=base + "/v1", max_retries=0, timeout=120).chat.completions.create(
        model="demo", max_tokens=6, temperature=0, messages=[{"role": "user", "content": "hello there"}])
    assert reply.choices[0].finish_reason in ("length", "stop")
    return reply.choices[0].message.content or ""


def tenant_key(base: str, tenant: str = "demo-chat") -> str:
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    tenants = httpx.get(base + "/admin/tenants", headers=headers, timeout=30).json()
    tenant_id = next(t["id"] for t in (tenants["data"] if isinstance(tenants, dict) else tenants)
                     if t["name"] == tenant)
    return str(httpx.post(f"{base}/admin/tenants/{tenant_id}/keys", headers=headers, json={"name": "t"},
                          timeout=30).json()["key"])


def test_gateway_replica_serves_a_worker_started_apart(tmp_path: Path, serve_env: dict[str, str], start_worker,
                                                       demo_model_dir: Path) -> None:
    """`sluice gateway`: no local worker, no embedded broker; it prints where HTTP listens and where
    workers connect, and a worker started apart (`sluice worker --gateway`) serves its requests."""
    from .conftest import WORKER_SECRET

    env = dict(serve_env, SLUICE_GATEWAY_WORKER_SECRET=WORKER_SECRET)
    port, worker_port = free_port(), free_port()
    replica = Serve(tmp_path, env, port, "--worker-port", str(worker_port), command="gateway")
    try:
        line = printed_line(replica, r"^sluice gateway replica (\S+) on http://([\d.]+):(\d+) "
                                     r"\(workers connect to ([\d.]+):(\d+)\)$")
        assert (int(line[3]), int(line[5])) == (port, worker_port) and line[1]
        assert not (tmp_path / "var" / "logs").exists()  # it started no worker
        ready = httpx.get(replica.base + "/ready", timeout=30)
        assert ready.status_code == 503 and ready.json()["checks"]["workers"] is False
        start_worker(demo_model_dir, worker_port, "apart")
        deadline = time.monotonic() + 180
        while not replica.admin("GET", "/admin/workers").json().get("workers"):
            assert time.monotonic() < deadline, "the worker did not register"
            time.sleep(0.2)
        assert chat(replica.base, tenant_key(replica.base))
    finally:
        assert replica.stop() == 0


def test_gateway_refuses_to_start_without_kafka_or_worker_secret(
        tmp_path: Path, in_serve_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch = in_serve_env
    monkeypatch.delenv("SLUICE_GATEWAY_WORKER_SECRET", raising=False)
    assert main(["gateway", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "SLUICE_GATEWAY_WORKER_SECRET" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("SLUICE_GATEWAY_WORKER_SECRET", "s" * 32)
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP_SERVERS", "")
    assert main(["gateway", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "SLUICE_KAFKA_BOOTSTRAP_SERVERS" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "var").exists()  # no broker, no database, nothing started


def test_serve_replicas_flags_fail_in_one_line(tmp_path: Path, in_serve_env: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch = in_serve_env
    monkeypatch.setenv("SLUICE_SHARED_URL", "")
    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "SLUICE_SHARED_URL" in err and "--replicas 2" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("SLUICE_SHARED_URL", "redis://127.0.0.1:6379/0")
    for flag, bad in (("--replicas", "0"), ("--replicas", "-1"), ("--replicas", "two"), ("--replicas", "1.5"),
                      ("--workers", "-1"), ("--workers", "x")):
        assert main(["serve", flag, bad]) == 2, (flag, bad)
        err = capsys.readouterr().err
        assert f"{flag} must be a whole number" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "var").exists()


REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "")


@pytest.mark.skipif(not REDIS_URL, reason="SLUICE_TEST_REDIS_URL is not set")
@pytest.mark.timeout(900)  # three processes start, one is killed and restarted with backoff: slow on 2 shared cores
def test_serve_replicas_answers_on_every_port(tmp_path: Path, serve_env: dict[str, str]) -> None:
    """`sluice serve --replicas 2 --workers 1`: two `sluice gateway` children on consecutive ports
    sharing Redis and one worker linked to both; each answers a chat completion. A killed replica
    is restarted and answers again; Ctrl-C stops everything."""
    env = dict(serve_env, SLUICE_SHARED_URL=REDIS_URL, SLUICE_SHARED_PREFIX=f"serve{time.monotonic_ns()}")
    env.pop("SLUICE_GATEWAY_WORKER_SECRET", None)  # the parent makes one for its children
    env["SLUICE_GATEWAY_WORKER_PORT"] = str(free_ports(2))  # each replica takes its own worker port
    port = free_ports(2)  # the second replica takes the next port
    cluster = Serve(tmp_path, env, port, "--replicas", "2", "--workers", "1")
    children: list[int] = []
    try:
        for i in range(2):
            line = printed_line(cluster, rf"^sluice serve: replica {i} on http://127.0.0.1:(\d+) "
                                         r"\(workers connect to 127.0.0.1:(\d+); log (\S+)\)$")
            assert int(line[1]) == port + i
        # After the replicas' lines:
        printed_line(cluster, r"local worker\(s\) per model, each linked to all 2 replicas")
        bases = [f"http://127.0.0.1:{port + i}" for i in range(2)]
        for base in bases:
            deadline = time.monotonic() + 240
            while True:
                try:
                    if len(httpx.get(base + "/admin/workers", timeout=10,
                                     headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).json()["workers"]) == 1:
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                assert cluster.process.poll() is None, Path(cluster.log.name).read_text()
                assert time.monotonic() < deadline, f"{base} got no worker"
                time.sleep(0.3)
        key = tenant_key(bases[0])
        answers = [chat(base, key) for base in bases]  # one key: both replicas share one database
        assert answers[0] == answers[1]  # greedy, the same worker
        # A replica that dies is restarted (with backoff) and serves again, its worker relinked.
        (victim,) = [pid for pid in _children(cluster.process.pid)
                     if f"--port\0{port + 1}\0" in Path(f"/proc/{pid}/cmdline").read_bytes().decode()]
        os.killpg(victim, signal.SIGKILL)
        deadline = time.monotonic() + 240
        while True:
            try:
                if chat(bases[1], key) == answers[1]:
                    break
            except (openai.OpenAIError, httpx.HTTPError):
                pass
            assert time.monotonic() < deadline, "the killed replica was not restarted"
            time.sleep(0.5)
        children = _children(cluster.process.pid)
        assert victim not in children
        assert len(children) >= 3  # two replicas and a worker
        secret_env = [_environ(pid).get("SLUICE_GATEWAY_WORKER_SECRET", "") for pid in children]
        assert all(len(s) >= 32 for s in secret_env) and len(set(secret_env)) == 1
        assert all(secret_env[0] not in Path(f"/proc/{pid}/cmdline").read_bytes().decode() for pid in children)
    finally:
        code = cluster.stop()
    assert code == 0
    time.sleep(1.0)
    assert all(not alive(pid) for pid in children)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
