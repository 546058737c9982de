"""A local scale-out cluster as real processes: N `sluice gateway` replicas and M `sluice worker`s.

Used by the scale-out acceptance tests (tests/integration/scaleout/) and `sluice bench scale-out`,
so both exercise exactly what an operator would run. The caller brings the services the replicas
share: a Kafka broker (bootstrap servers), an empty database (PostgreSQL: several processes write
to it) and Redis. The database is migrated once here, before any replica starts, so three
replicas never race Alembic on a fresh schema.

Every replica gets its own HTTP and worker port and its own per-request record file (the
worker-side timestamps the tests and the bench join on); every worker is linked to every replica
(`--gateway h:p,h:p,...`). Processes run in their own process groups, logs go to files under the
work dir, and `stop()` ends all of them (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sluice.broker import free_port
from sluice.errors import CLIError
from sluice.telemetry import RequestRecord, read_records

STARTUP_TIMEOUT_S = 180.0
SRC = Path(__file__).resolve().parents[2]  # the folder holding sluice and sluice_lab


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What the cluster is made of and the services it shares."""

    workdir: Path
    model_dir: Path
    bootstrap_servers: str
    database_url: str  # an empty database; sqlalchemy form (postgresql+asyncpg://...)
    shared_url: str  # redis://...
    shared_prefix: str
    admin_token: str = field(repr=False)
    worker_secret: str = field(repr=False)
    replicas: int = 3
    workers: int = 2
    lease_s: float = 2.0
    topic_prefix: str = "scaleout"
    partitions: int = 6  # several per replica, so a rebalance has something to move
    worker_max_num_seqs: int = 8
    # Extra sluice.toml text (e.g. a [scheduler] section) and environment for every process.
    sluice_toml: str = ""
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.workers < 1:
            raise ValueError(f"a cluster needs at least one replica and one worker, got {self.replicas} and "
                             f"{self.workers}")


@dataclass
class Process:
    """One child process in its own process group, logging to a file."""

    name: str
    args: list[str]
    env: dict[str, str] = field(repr=False)
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.args, cwd=Path.cwd(), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def kill(self) -> None:
        """SIGKILL to the whole group, as a crash would: nothing runs its shutdown."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def terminate(self) -> None:
        """SIGTERM to the group (a clean shutdown), without waiting for it."""
        if self.popen is None or self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)

    def wait_or_kill(self, grace_s: float) -> None:
        """Waits up to `grace_s` for the process to end, then SIGKILLs it."""
        if self.popen is None:
            return
        try:
            self.popen.wait(max(grace_s, 0.0))
        except subprocess.TimeoutExpired:
            self.kill()

    def stop(self, grace_s: float = 10.0) -> None:
        self.terminate()
        self.wait_or_kill(grace_s)

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Replica:
    index: int
    port: int
    worker_port: int
    record_log: Path
    process: Process

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def worker_address(self) -> str:
        return f"127.0.0.1:{self.worker_port}"

    def records(self) -> list[RequestRecord]:
        return read_records(self.record_log) if self.record_log.is_file() else []


@dataclass
class Cluster:
    spec: ClusterSpec
    replicas: list[Replica]
    workers: list[Process]

    # ---- admin API ------------------------------------------------------------------------------

    def admin(self, method: str, path: str, *, replica: int = 0, body: dict[str, Any] | None = None) -> Any:
        response = httpx.request(method, f"{self.replicas[replica].base_url}/admin{path}", json=body,
                                 headers={"authorization": f"Bearer {self.spec.admin_token}"}, timeout=30)
        if response.status_code >= 400:
            raise CLIError(f"admin API {method} {path} on replica {replica} answered {response.status_code}: "
                           f"{response.text[:300]}")
        return response.json()

    def new_tenant(self, name: str, *, replica: int = 0, **fields: Any) -> tuple[str, str, str]:
        """A tenant (fields as the admin API takes them: quotas, weight, priority_ceiling, ...);
        returns (tenant id, key id, key)."""
        tenant = self.admin("POST", "/tenants", replica=replica, body={"name": name, **fields})
        key = self.admin("POST", f"/tenants/{tenant['id']}/keys", replica=replica, body={"name": "scaleout"})
        return str(tenant["id"]), str(key["id"]), str(key["key"])

    def linked_workers(self, replica: int) -> int:
        """Workers registered with this replica right now."""
        view = self.admin("GET", "/workers", replica=replica)
        return len(view.get("workers", []) if isinstance(view, dict) else view)

    def records(self) -> list[RequestRecord]:
        """Every replica's per-request records (the dead ones' too: their files stay)."""
        return [record for replica in self.replicas for record in replica.records()]

    # ---- lifecycle ------------------------------------------------------------------------------

    def start_replica(self, index: int) -> None:
        """(Re)start replica `index` on its ports; returns once it answers (not waiting for workers)."""
        replica = self.replicas[index]
        replica.process.start()
        _wait(lambda: _ready(replica.base_url), replica.process, "to answer /ready")

    def wait_linked(self, replicas: list[int] | None = None, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until every worker is registered with each of these replicas (default: the live ones)."""
        indexes = replicas if replicas is not None else [r.index for r in self.replicas if r.process.alive]
        for index in indexes:
            replica = self.replicas[index]
            _wait(lambda replica=replica: self._linked(replica.index), replica.process,
                  f"to see {len(self.workers)} worker(s)", timeout_s)

    def _linked(self, index: int) -> bool:
        try:
            return self.linked_workers(index) >= len(self.workers)
        except (httpx.HTTPError, CLIError):
            return False

    def stop(self, grace_s: float = 10.0) -> None:
        """Every process told at once, then waited for: one after another, five processes took
        about 20 s of a test module's teardown (each replica leaving its consumer groups in turn
        made the others rebalance before they left too)."""
        processes = [*self.workers, *(replica.process for replica in self.replicas)]
        for process in processes:
            process.terminate()
        deadline = time.monotonic() + grace_s
        for process in processes:
            process.wait_or_kill(deadline - time.monotonic())

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tails(self, lines: int = 15) -> str:
        parts = [f"--- {p.name} ({p.log_path})\n{p.log_tail(lines)}"
                 for p in [r.process for r in self.replicas] + self.workers]
        return "\n".join(parts)


async def postgres_execute(server_url: str, sql: str) -> None:
    """One statement on a PostgreSQL server (CREATE/DROP DATABASE for a cluster's fresh database)."""
    import asyncpg

    conn = await asyncpg.connect(server_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def drop_redis_prefix(redis_url: str, prefix: str) -> None:
    """Removes every key a cluster wrote under its `[shared] prefix`."""
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


def _ready(base_url: str) -> bool:
    """/ready's checks all pass, except perhaps `workers`: they connect once the replicas listen."""
    try:
        checks = httpx.get(f"{base_url}/ready", timeout=5).json().get("checks", {})
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
    return bool(checks) and all(ok for name, ok in checks.items() if name != "workers")


def _wait(predicate: Any, process: Process, what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if not process.alive:
            raise CLIError(f"{process.name} exited during startup:\n{process.log_tail()}")
        if time.monotonic() > deadline:
            raise CLIError(f"{process.name} took more than {timeout_s:.0f} s {what}:\n{process.log_tail()}")
        time.sleep(0.2)


def write_config(directory: Path, spec: ClusterSpec) -> Path:
    """The config dir every process reads: the demo model as "demo", no seed tenants."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sluice.toml").write_text(
        "[dispatch]\nlocal_workers = 0\nheartbeat_interval_s = 0.5\nheartbeat_timeout_s = 5.0\n"
        f"[engine]\nmax_num_seqs = {spec.worker_max_num_seqs}\nmax_num_batched_tokens = 512\n" + spec.sluice_toml)
    (directory / "models.toml").write_text(f'[[models]]\nname = "demo"\npath = "{spec.model_dir}"\n')
    (directory / "tenants.toml").write_text("")
    return directory


def _base_env(spec: ClusterSpec, config_dir: Path) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=str(SRC),
        OMP_NUM_THREADS="1",  # one torch thread per process: 2 shared cores, several processes
        SLUICE_CONFIG_DIR=str(config_dir),
        SLUICE_KAFKA_BOOTSTRAP_SERVERS=spec.bootstrap_servers,
        SLUICE_KAFKA_TOPIC_PREFIX=spec.topic_prefix,
        SLUICE_KAFKA_PARTITIONS=str(spec.partitions),
        SLUICE_DATABASE_URL=spec.database_url,
        SLUICE_SHARED_URL=spec.shared_url,
        SLUICE_SHARED_PREFIX=spec.shared_prefix,
        SLUICE_SHARED_LEASE_S=str(spec.lease_s),
        SLUICE_GATEWAY_WORKER_SECRET=spec.worker_secret,
        SLUICE_ADMIN_TOKEN=spec.admin_token,
        SLUICE_ADMIN_DEMO_TENANT="",
        **dict(spec.env),
    )


def _gateway_args(port: int, worker_port: int) -> list[str]:
    return [sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "gateway", "--host", "127.0.0.1",
            "--port", str(port), "--worker-port", str(worker_port)]


def start_cluster(spec: ClusterSpec) -> Cluster:
    """Migrate the database, start the workers and the first replica (alone: it creates the admin
    token and the topics), then the others; returns once every worker is linked to every replica."""
    from sluice.gateway.db.migrate import migrate

    spec.workdir.mkdir(parents=True, exist_ok=True)
    config_dir = write_config(spec.workdir / "config", spec)
    env = _base_env(spec, config_dir)
    asyncio.run(migrate(spec.database_url))
    replicas = []
    for index in range(spec.replicas):
        port, worker_port = free_port(), free_port()
        record_log = spec.workdir / f"records-{index}.jsonl"
        process = Process(f"replica-{index}", _gateway_args(port, worker_port),
                          {**env, "SLUICE_GATEWAY_RECORD_LOG_PATH": str(record_log)},
                          spec.workdir / f"replica-{index}.log")
        replicas.append(Replica(index, port, worker_port, record_log, process))
    addresses = ",".join(r.worker_address for r in replicas)
    workers = [
        Process(f"worker-{index}",
                [sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "worker", "--model",
                 str(spec.model_dir), "--served-model-name", "demo", "--gateway", addresses,
                 "--worker-id", f"w{index}", "--heartbeat-interval", "0.5"],
                env, spec.workdir / f"worker-{index}.log")
        for index in range(spec.workers)]
    cluster = Cluster(spec, replicas, workers)
    try:
        for worker in workers:  # they load the model meanwhile, and connect once each replica listens
            worker.start()
        cluster.start_replica(0)
        for replica in replicas[1:]:
            replica.process.start()
        for replica in replicas[1:]:
            _wait(lambda replica=replica: _ready(replica.base_url), replica.process, "to answer /ready")
        cluster.wait_linked()
    except BaseException:
        cluster.stop()
        raise
    return cluster
