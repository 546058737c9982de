"""`sluice serve --replicas N --workers M`: a local trial cluster on one machine.

The parent process starts what the replicas share, then the replicas and the workers, and
supervises them (a dead child is restarted with backoff; see `gateway/launch/children.py`):

1. the embedded broker, unless Kafka is configured;
2. the database: migrated, seed tenants created, the admin token and the demo tenant's key made
   and shown once, all here, before any replica starts (N replicas migrating or seeding one
   database at once would race; each replica's own startup then finds it all in place);
3. N `sluice gateway` children on consecutive HTTP ports (port, port+1, ...) and consecutive worker
   ports, each a full replica (docs/scale-out.md), sharing `[shared] url` (required for N > 1:
   without it every replica would keep its own quotas);
4. M `sluice worker` children per model, each linked to every replica (`--gateway a,b,...`).

The worker secret (configured, or generated here for a loopback worker host) reaches every child
through its environment, never argv. Signals to this process:

- SIGHUP: a rolling restart (`rolling_restart`): one replica at a time is drained, started again
  and waited for until ready, so the cluster keeps serving throughout (docs/scale-out.md);
- SIGTERM: every replica drains (its open requests finish), then the workers and the broker stop;
- Ctrl-C (SIGINT): the workers, the replicas and the broker stop at once.

The children also exit by themselves if this process is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from sluice.errors import CLIError
from sluice.gateway.launch.children import ChildProcesses, ChildSpec, LocalWorkers
from sluice.gateway.launch.serve import (
    check_engine_options,
    prepare_models,
    print_demo_key,
    resolve_settings,
    reveal_secret,
)
from sluice.settings import Settings

if TYPE_CHECKING:
    from sluice.gateway.admin.seed import DemoKey

STOP_MARGIN_S = 15.0  # past the drain timeout, for the replica's own shutdown, before SIGKILL
READY_TIMEOUT_S = 180.0  # a restarted replica must answer /ready within this (rolling restart)


def cluster_ports(settings: Settings, replicas: int) -> tuple[list[int], list[int]]:
    """(HTTP ports, worker ports), consecutive from the configured ones; a worker port of 0 means
    free ports picked here (the workers must be told them). Fails in one line on a port in use."""
    from sluice.broker import free_port, port_in_use

    gw = settings.gateway
    http = [gw.port + i for i in range(replicas)]
    workers = [gw.worker_port + i for i in range(replicas)] if gw.worker_port else [free_port() for _ in http]
    if max(http) > 65535 or max(workers) > 65535:
        raise CLIError(f"{replicas} replicas need {replicas} consecutive ports from {gw.port} and from "
                       f"{gw.worker_port}: past 65535")
    for port in http:
        if port_in_use(gw.host, port):
            raise CLIError(f"port {port} on {gw.host} is already in use (replicas take ports {http[0]}-{http[-1]}): "
                           "stop what holds it or pass --port")
    for port in workers:
        if port_in_use(gw.worker_host, port):
            raise CLIError(f"the worker port {port} on {gw.worker_host} is already in use (replicas take "
                           f"{workers[0]}-{workers[-1]}): set SLUICE_GATEWAY_WORKER_PORT to a free one")
    return http, workers


async def prepare_database(settings: Settings, *, renew_demo_key: bool) -> tuple[str | None, DemoKey | None]:
    """Migrates, seeds, and makes the admin token and demo key once, before the replicas start.
    Returns (a generated admin token or None, the demo key or None)."""
    from sluice.gateway.admin.seed import ensure_demo_key, seed_tenants
    from sluice.gateway.admin.service import AdminService
    from sluice.gateway.auth.service import AuthService
    from sluice.gateway.db.migrate import migrate
    from sluice.gateway.db.session import make_engine, make_session_factory

    await migrate(settings.database.url)
    engine = make_engine(settings.database.url, echo=settings.database.echo)
    sessions = make_session_factory(engine)
    auth = AuthService(sessions)
    admin = AdminService(sessions, auth)
    try:
        generated = await auth.ensure_admin_token(settings.admin.token)
        await seed_tenants(admin, settings.tenants)
        demo = None
        if settings.admin.demo_tenant:
            demo = await ensure_demo_key(admin, settings.admin.demo_tenant,
                                         ttl_days=settings.admin.demo_key_ttl_days, renew=renew_demo_key)
        return generated, demo
    finally:
        await auth.drain()
        await engine.dispose()


def _replica_args(args: argparse.Namespace, settings: Settings, port: int, worker_port: int) -> tuple[str, ...]:
    gw = settings.gateway
    out = ["--log-level", str(getattr(args, "log_level", "INFO")), "gateway", "--host", gw.host,
           "--port", str(port), "--worker-port", str(worker_port), "--exit-with-parent"]
    config_dir = Path(settings.config_dir)
    if config_dir.is_dir():
        out += ["--config", str(config_dir.resolve())]
    if args.model is not None:
        out += ["--model", str(Path(args.model).resolve())]
    elif args.demo:
        out.append("--demo")
    return tuple(out)


def run_cluster(args: argparse.Namespace, replicas: int) -> int:
    from sluice.broker import EmbeddedBroker
    from sluice.gateway.dispatch.links.tcp import worker_secret_for

    settings = resolve_settings(args)
    if not settings.shared.url:
        raise CLIError(f"--replicas {replicas} needs state the replicas share: set SLUICE_SHARED_URL (or [shared] "
                       "url) to a Redis URL, e.g. redis://127.0.0.1:6379/0")
    check_engine_options(settings, args.device)
    http_ports, worker_ports = cluster_ports(settings, replicas)
    prepare_models(settings)
    secret = worker_secret_for(settings)
    var = Path("var")
    broker: EmbeddedBroker | None = None
    if not settings.kafka.bootstrap_servers:
        b = settings.broker
        var.mkdir(exist_ok=True)
        broker = EmbeddedBroker(host=b.host, port=b.port, storage=b.storage, log_path=var / "broker.log").start()
        settings = msgspec.structs.replace(
            settings, kafka=msgspec.structs.replace(settings.kafka, bootstrap_servers=broker.bootstrap_servers))
        print(f"embedded Kafka broker on {broker.bootstrap_servers} (pid {broker.pid}, storage {b.storage})",
              flush=True)
    try:
        generated, demo = asyncio.run(prepare_database(settings, renew_demo_key=bool(args.new_demo_key)))
        if generated:
            print(reveal_secret("admin token (shown once, stored hashed)", generated, var / "admin_token"),
                  flush=True)
        return asyncio.run(_run(args, settings, secret, http_ports, worker_ports, demo, var))
    finally:
        if broker is not None:
            broker.stop()


async def _run(args: argparse.Namespace, settings: Settings, secret: str, http_ports: list[int],
               worker_ports: list[int], demo: DemoKey | None, var: Path) -> int:
    gw = settings.gateway
    # The replicas read the parent's settings (same files, same environment) plus what was decided
    # here: the broker and the worker secret.
    env = dict(os.environ, SLUICE_KAFKA_BOOTSTRAP_SERVERS=settings.kafka.bootstrap_servers,
               SLUICE_GATEWAY_WORKER_SECRET=secret)
    gateways = ChildProcesses("replica", var / "logs")
    workers = LocalWorkers(settings, settings.dispatch.local_workers, args.device, var / "logs")
    stop = asyncio.Event()
    stop_signal: list[signal.Signals] = []  # the first stop signal received
    loop = asyncio.get_running_loop()

    def on_stop(sig: signal.Signals) -> None:
        stop_signal.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop, sig)
    rolling: list[asyncio.Task[None]] = []

    def roll() -> None:
        if rolling and not rolling[-1].done():
            print("sluice serve: SIGHUP: a rolling restart is already under way", flush=True)
            return
        rolling.append(asyncio.create_task(rolling_restart(gateways, gw.host, http_ports, gw.drain_timeout_s)))

    loop.add_signal_handler(signal.SIGHUP, roll)
    try:
        for i, (port, worker_port) in enumerate(zip(http_ports, worker_ports, strict=True)):
            gateways.start(str(i), ChildSpec(_replica_args(args, settings, port, worker_port), env))
            print(f"sluice serve: replica {i} on http://{gw.host}:{port} (workers connect to "
                  f"{gw.worker_host}:{worker_port}; log {gateways.log_path(str(i))})", flush=True)
        workers.spawn_all(worker_ports, secret)
        print(f"sluice serve: {workers.count} local worker(s) per model, each linked to all {len(http_ports)} "
              "replicas", flush=True)
        if settings.admin.demo_tenant:
            print_demo_key(demo, settings, gw.host, http_ports[0], var)
        supervisors = [asyncio.create_task(gateways.supervise()), asyncio.create_task(workers.supervise())]
        await stop.wait()
        for task in [*supervisors, *rolling]:
            task.cancel()
    finally:
        if stop_signal[:1] == [signal.SIGTERM]:
            # Every replica drains (its open requests finish on the workers), then the workers stop.
            await asyncio.to_thread(gateways.stop, gw.drain_timeout_s + STOP_MARGIN_S, signal.SIGTERM)
            await asyncio.to_thread(workers.stop)
        else:  # Ctrl-C: at once
            await asyncio.to_thread(workers.stop)
            await asyncio.to_thread(gateways.stop, 10.0, signal.SIGINT)
    return 0


async def rolling_restart(gateways: ChildProcesses, host: str, http_ports: list[int], drain_timeout_s: float) -> None:
    """SIGHUP: each replica in turn is drained (SIGTERM), started again, and waited for until it
    is ready (`/ready`: database, Redis, broker and a linked worker) before the next one goes, so
    at most one replica is out at any time. A replica that does not get ready stops the roll
    (the others are left running, untouched)."""
    print(f"sluice serve: rolling restart of {len(http_ports)} replicas", flush=True)
    for i, port in enumerate(http_ports):
        code = await asyncio.to_thread(gateways.restart, str(i), drain_timeout_s + STOP_MARGIN_S)
        how = f"exit code {code}" if code is not None else "killed after the drain timeout"
        print(f"sluice serve: rolling restart: replica {i} stopped ({how}), started again", flush=True)
        if not await _ready(f"http://{host}:{port}/ready", READY_TIMEOUT_S):
            print(f"sluice serve: rolling restart stopped: replica {i} was not ready within {READY_TIMEOUT_S:.0f}s "
                  f"(log {gateways.log_path(str(i))})", flush=True)
            return
        print(f"sluice serve: rolling restart: replica {i} ready", flush=True)
    print("sluice serve: rolling restart done", flush=True)


async def _ready(url: str, timeout_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url)).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    return False
