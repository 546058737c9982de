"""One gateway process: `sluice serve` (broker + gateway + local workers) and `sluice gateway` (a replica).

`run_gateway(settings, role)` is the one way a gateway process runs; the `GatewayRole` says what it
runs besides the app. `sluice serve` (single process): the embedded broker when
`kafka.bootstrap_servers` is empty (its own process, so a gateway crash does not take the queue
with it), local workers, and the demo key. `sluice gateway`: one replica of a cluster, with none
of those: it needs Kafka and the workers' shared secret configured (every replica and worker must
hold the same secret, so a replica never makes one up), and workers started elsewhere connect to
its worker port (`sluice worker --gateway a:p,b:p,...`). `sluice serve --replicas N` runs N of
those as children (`gateway/launch/replicas.py`).

Order: load settings → check ports and model directories (creating a missing model: fetching a
real one, or building the demo model) → start the embedded broker if the role has one → build the
app over a `KafkaBackend` → run it with uvicorn. At startup the app migrates the database, seeds
tenants and creates the admin token; `serve` keeps ONE expiring API key for the demo tenant
(`admin.demo_tenant`, see `gateway/admin/seed.py`), spawns the local workers (the worker secret reaches
them through their environment, never argv or a log) and prints a copy-paste curl. Secrets (a
generated admin token, a new demo key) go to the terminal when stdout is one; otherwise into 0600
files under var/, never into a log. SIGTERM first drains (gateway/cluster/drain.py: new requests get 503,
open ones finish, for at most `[gateway] drain_timeout_s`); Ctrl-C (or a second SIGTERM) stops at
once. Then the workers stop (process groups, terminate then kill), the gateway and the broker it
started; workers (and replicas started by `serve --replicas`) also exit by themselves if their
parent is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import msgspec

from sluice.errors import CLIError
from sluice.gateway.launch.children import HEALTHY_RUN_S, RESTART_BACKOFF_S, LocalWorkers, restart_delay
from sluice.settings import ModelSpec, Settings, load_settings

if TYPE_CHECKING:
    from sluice.gateway.admin.seed import DemoKey

log = logging.getLogger(__name__)

__all__ = ["HEALTHY_RUN_S", "RESTART_BACKOFF_S", "GatewayRole", "LocalWorkers", "gateway", "restart_delay",
           "run_gateway", "serve"]


def reveal_secret(label: str, value: str, path: Path) -> str:
    """The line to print for a secret: itself on an interactive terminal, else where it was written
    (a 0600 file), so that a redirected stdout (a log file) never holds it."""
    if sys.stdout.isatty():
        return f"{label}: {value}"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value + "\n")
    os.chmod(path, 0o600)
    return f"{label}: written to {path} (stdout is not a terminal)"


@dataclass(frozen=True, slots=True)
class GatewayRole:
    """What a gateway process runs besides the app."""

    local_workers: int = 0  # worker processes per model, spawned and supervised here
    device: str = "cpu"  # of the local workers
    embedded_broker: bool = False  # start one when kafka.bootstrap_servers is empty
    demo_key: bool = False  # keep the demo tenant's key and print how to try it
    renew_demo_key: bool = False
    replica: bool = False  # `sluice gateway`: announce the replica id
    parent_pid: int | None = None  # exit once this process is gone (replicas spawned by `serve`)


def parse_count(flag: str, value: str | None, *, minimum: int) -> int | None:
    """A whole-number flag read as text, so a bad value is one line (argparse adds its usage)."""
    if value is None:
        return None
    text = value.strip()
    if not text.lstrip("-").isdigit() or int(text) < minimum:
        more = "zero or more" if minimum == 0 else f"{minimum} or more"
        raise CLIError(f"{flag} must be a whole number, {more}; got {value!r}")
    return int(text)



def resolve_settings(args: argparse.Namespace) -> Settings:
    """Settings with the flags of `serve` / `gateway` applied (those a command lacks are skipped)."""
    settings = load_settings(args.config)
    gateway = settings.gateway
    if args.host is not None:
        gateway = msgspec.structs.replace(gateway, host=args.host)
    if args.port is not None:
        if not 0 < args.port < 65536:
            raise CLIError(f"--port must be between 1 and 65535, got {args.port}")
        gateway = msgspec.structs.replace(gateway, port=args.port)
    worker_port = getattr(args, "worker_port", None)
    if worker_port is not None:
        if not 0 <= worker_port < 65536:
            raise CLIError(f"--worker-port must be between 0 (any free port) and 65535, got {worker_port}")
        gateway = msgspec.structs.replace(gateway, worker_port=worker_port)
    dispatch = settings.dispatch
    workers = parse_count("--workers", getattr(args, "workers", None), minimum=0)
    if workers is not None:
        dispatch = msgspec.structs.replace(dispatch, local_workers=workers)
    models = _selected_models(settings.models, demo=args.demo)
    if args.model is not None:
        path = Path(args.model)
        if not path.is_dir():
            raise CLIError(
                f"model directory {path} does not exist (create one with `sluice model make-demo DIR`)"
            )
        # Keep the configured name when models.toml lists this directory (tenants' allowed_models
        # refer to it); otherwise the directory's name.
        known = [m for m in settings.models if Path(m.path).resolve() == path.resolve()]
        name = known[0].name if known else path.resolve().name
        models = (ModelSpec(name=name, path=str(path)),)
    if not models:
        raise CLIError("no model to serve: list one in models.toml or pass --model DIR")
    return msgspec.structs.replace(settings, gateway=gateway, dispatch=dispatch, models=models)


def _selected_models(models: tuple[ModelSpec, ...], *, demo: bool) -> tuple[ModelSpec, ...]:
    """--demo: the demo models only. Otherwise the real ones, or the demo ones when models.toml
    lists nothing else (an offline setup)."""
    demos = tuple(m for m in models if m.demo)
    if demo:
        if not demos:
            raise CLIError("--demo: models.toml lists no model with demo = true")
        return demos
    return tuple(m for m in models if not m.demo) or demos


def prepare_models(settings: Settings) -> None:
    # Imported only to create a missing directory: they need torch, which a gateway-only install
    # (`sluice[gateway]`, the gateway image) lacks, and a present model needs neither.
    for model in settings.models:
        path = Path(model.path)
        if (path / "config.json").is_file():
            continue
        if model.fetch is not None:
            from sluice.workers.model.fetch import fetch_model

            print(f"fetching the model {model.name!r} into {path} (first run only; a few minutes) ...", flush=True)
            fetch_model(model.fetch, path)
            continue
        if not model.demo:
            raise CLIError(
                f"model {model.name!r}: directory {path} has no config.json; fix its path in models.toml"
            )
        from sluice.workers.demo import make_demo_model

        print(f"creating the demo model {model.name!r} in {path} ...", flush=True)
        make_demo_model(path, seed=0)


def check_engine_options(settings: Settings, device: str) -> None:
    """Fail at start, in one line, on [engine] options the workers would reject (and be restarted for)."""
    from sluice.workers.config import EngineConfig

    options = {k: v for k, v in settings.engine.items() if k not in ("model", "device")}
    try:
        EngineConfig(model=settings.models[0].path, device=device, **options)
    except (TypeError, ValueError) as exc:  # TypeError: an unknown key
        raise CLIError(f"[engine] settings: {exc}") from None


def check_ports(settings: Settings) -> None:
    from sluice.broker import port_in_use
    from sluice.gateway.dispatch.links.upstream import upstream_api_key

    for spec in settings.upstreams:  # not a port, but as cheap to check before anything starts
        try:
            upstream_api_key(spec)
        except ValueError as exc:
            raise CLIError(str(exc)) from None

    gw = settings.gateway
    if port_in_use(gw.host, gw.port):
        raise CLIError(f"port {gw.port} on {gw.host} is already in use: stop what holds it or pass --port")
    if gw.worker_port and port_in_use(gw.worker_host, gw.worker_port):
        raise CLIError(
            f"the worker port {gw.worker_port} on {gw.worker_host} is already in use: "
            "set SLUICE_GATEWAY_WORKER_PORT to a free port"
        )


TRY_QUESTION = "What is the capital of France? Answer in one sentence."


def curl_snippet(host: str, port: int, key: str, model: str, key_file: Path | None = None) -> str:
    # temperature 0: greedy, so the first answer a newcomer sees is the model's best one.
    body = json.dumps({"model": model, "stream": True, "max_tokens": 64, "temperature": 0,
                       "messages": [{"role": "user", "content": TRY_QUESTION}]})
    return (
        f"curl -N http://{host}:{port}/v1/chat/completions \\\n"
        f"  -H \"Authorization: Bearer {key if key_file is None else f'$(cat {key_file})'}\" "
        "-H 'Content-Type: application/json' \\\n"
        f"  -d '{body}'"
    )


def openai_snippet(host: str, port: int, key: str, model: str, key_file: Path | None = None) -> str:
    api_key = repr(key) if key_file is None else f"open({str(key_file)!r}).read().strip()"
    return (
        "python - <<'EOF'\n"
        "from openai import OpenAI\n"
        f"client = OpenAI(base_url='http://{host}:{port}/v1', api_key={api_key})\n"
        f"reply = client.chat.completions.create(model='{model}', max_tokens=64, temperature=0,\n"
        f"    messages=[{{'role': 'user', 'content': '{TRY_QUESTION}'}}])\n"
        "print(reply.choices[0].message.content)\n"
        "EOF"
    )


def server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after its shutdown, which would kill this process before
        it stops the broker and the workers; here a signal only asks the server to exit. Once
        started, the first SIGTERM calls `on_term` instead (the drain, gateway/cluster/drain.py, which sets
        `should_exit` when done); SIGINT and a second SIGTERM exit at once."""

        on_term: Callable[[], None] | None = None

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def _on_signal(self, sig: int, frame: FrameType | None) -> None:
            on_term = self.on_term
            if sig == signal.SIGTERM and on_term is not None and self.started and not self.should_exit:
                self.on_term = None  # the next SIGTERM exits at once
                on_term()
            else:
                self.handle_exit(sig, frame)

    return Server


def print_demo_key(demo: DemoKey | None, settings: Settings, host: str, port: int, var: Path) -> None:
    """What `serve` says about the demo tenant's key: the new key (shown once) with a curl and an
    openai snippet, or that it exists already."""
    demo_tenant = settings.admin.demo_tenant
    if demo is None:
        print(f"no tenant named {demo_tenant!r} in tenants.toml: create a key with the admin API", flush=True)
    elif demo.key is None:
        print(f"the demo key of tenant {demo_tenant!r} ({demo.prefix}..., expires {demo.expires_at:%Y-%m-%d}) "
              "was shown when it was created; `sluice serve --new-demo-key` replaces it", flush=True)
    else:
        print(reveal_secret(f"new API key for tenant {demo_tenant!r} (expires {demo.expires_at:%Y-%m-%d})",
                            demo.key, var / "demo_key"), flush=True)
        # On a terminal the snippets hold the key; otherwise they read it from its 0600 file.
        key_file = None if sys.stdout.isatty() else (var / "demo_key").resolve()
        model = settings.models[0].name
        print("try:\n" + curl_snippet(host, port, demo.key, model, key_file), flush=True)
        print("or with the openai SDK:\n" + openai_snippet(host, port, demo.key, model, key_file), flush=True)


def check_replica_settings(settings: Settings) -> None:
    """`sluice gateway` runs against a cluster's services; fail in one line on what it lacks."""
    if not settings.kafka.bootstrap_servers:
        raise CLIError("sluice gateway needs Kafka: set SLUICE_KAFKA_BOOTSTRAP_SERVERS (or [kafka] "
                       "bootstrap_servers); `sluice serve` starts an embedded broker instead")
    if not settings.gateway.worker_secret:
        raise CLIError("sluice gateway needs the workers' shared secret: set SLUICE_GATEWAY_WORKER_SECRET "
                       "(or [gateway] worker_secret) to the same value on every replica and worker")


def serve(args: argparse.Namespace) -> int:
    """`sluice serve`: one process (today's default), or with `--replicas N` (N > 1) a local cluster."""
    replicas = parse_count("--replicas", getattr(args, "replicas", None), minimum=1)
    if replicas is not None and replicas > 1:
        from sluice.gateway.launch.replicas import run_cluster

        return run_cluster(args, replicas)
    settings = resolve_settings(args)
    check_engine_options(settings, args.device)
    check_ports(settings)
    prepare_models(settings)
    return run_gateway(settings, GatewayRole(
        local_workers=settings.dispatch.local_workers, device=args.device, embedded_broker=True,
        demo_key=True, renew_demo_key=bool(getattr(args, "new_demo_key", False))))


def gateway(args: argparse.Namespace) -> int:
    """`sluice gateway`: one replica, no local workers, no embedded broker."""
    settings = resolve_settings(args)
    check_replica_settings(settings)
    check_ports(settings)
    prepare_models(settings)
    return run_gateway(settings, GatewayRole(replica=True,
                                             parent_pid=os.getppid() if args.exit_with_parent else None))


def run_gateway(settings: Settings, role: GatewayRole) -> int:
    """Runs one gateway process until SIGTERM/SIGINT (see the module docstring)."""
    import uvicorn

    from sluice.broker import EmbeddedBroker
    from sluice.gateway.admin.seed import ensure_demo_key
    from sluice.gateway.app import create_app
    from sluice.gateway.batches import batch_components
    from sluice.gateway.cluster.shared import open_shared
    from sluice.gateway.queueing.acceptance import KafkaBackend
    from sluice.gateway.services import services

    var = Path("var")
    broker: EmbeddedBroker | None = None
    if role.embedded_broker and not settings.kafka.bootstrap_servers:
        b = settings.broker
        var.mkdir(exist_ok=True)
        broker = EmbeddedBroker(
            host=b.host, port=b.port, storage=b.storage, log_path=var / "broker.log"
        ).start()
        settings = msgspec.structs.replace(
            settings,
            kafka=msgspec.structs.replace(settings.kafka, bootstrap_servers=broker.bootstrap_servers),
        )
        print(
            f"embedded Kafka broker on {broker.bootstrap_servers} (pid {broker.pid}, storage {b.storage})",
            flush=True,
        )
    workers = LocalWorkers(settings, role.local_workers, role.device, var / "logs")
    batches = batch_components(settings)
    shared = open_shared(settings.shared, stream_retention_s=settings.gateway.stream_retention_s)
    backend = KafkaBackend(settings, batch_handler=batches.handler, shared=shared)
    gw = settings.gateway
    tasks: list[asyncio.Task[None]] = []
    server: Any = None  # the uvicorn server, made below

    def announce(kind: str, value: str) -> None:
        if kind == "admin_token":
            print(reveal_secret("admin token (shown once, stored hashed)", value, var / "admin_token"),
                  flush=True)

    async def watch_parent(parent_pid: int) -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(1.0)
        log.warning("the parent process %d is gone; gateway exiting", parent_pid)
        server.should_exit = True

    async def drain_then_exit(app: Any) -> None:
        found = services(app)
        try:
            await found.drain.run(lambda: len(found.generation.flights), backend.stop_consuming, found.streams.stop)
        finally:
            server.should_exit = True

    def on_sigterm(app: Any, loop: asyncio.AbstractEventLoop) -> None:
        # Called by the signal handler (between two bytecodes of the loop's thread): schedule only.
        loop.call_soon_threadsafe(lambda: tasks.append(asyncio.ensure_future(drain_then_exit(app))))

    async def after_start(app: Any) -> None:
        server.on_term = functools.partial(on_sigterm, app, asyncio.get_running_loop())
        if role.parent_pid is not None:
            tasks.append(asyncio.create_task(watch_parent(role.parent_pid)))
        if role.replica:
            print(f"sluice gateway replica {shared.replica} on http://{gw.host}:{gw.port} "
                  f"(workers connect to {gw.worker_host}:{backend.worker_port})", flush=True)
            return
        workers.spawn_all([backend.worker_port], backend.dispatcher.worker_port.worker_secret)
        tasks.append(asyncio.create_task(workers.supervise()))
        print(
            f"sluice gateway on http://{gw.host}:{gw.port} (workers connect to "
            f"{gw.worker_host}:{backend.worker_port}; {workers.count} local worker(s) per model)",
            flush=True,
        )
        if role.demo_key and settings.admin.demo_tenant:
            demo = await ensure_demo_key(services(app).admin, settings.admin.demo_tenant,
                                         ttl_days=settings.admin.demo_key_ttl_days, renew=role.renew_demo_key)
            print_demo_key(demo, settings, gw.host, gw.port, var)

    async def before_stop(app: Any) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.to_thread(workers.stop)

    app = create_app(
        settings,
        backend,
        batches=batches,
        on_startup=[after_start],
        on_shutdown=[before_stop],
        announce_secret=announce,
        shared=shared,
    )
    config = uvicorn.Config(
        app, host=gw.host, port=gw.port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5
    )
    server = server_class()(config)
    try:
        server.run()
    finally:
        workers.stop()
        if broker is not None:
            broker.stop()
    if not server.started:
        if shared.refused is not None:
            raise shared.refused
        raise CLIError("the gateway failed to start; see the messages above")
    return 0
