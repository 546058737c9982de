"""`sluice serve`: broker (if none configured) + gateway (HTTP and worker port) + local workers.

Order: load settings → check ports and model directories (creating a missing model: fetching a
real one, or building the demo model) →
start the embedded broker as its own process when `kafka.bootstrap_servers` is empty (so a
gateway crash does not take the queue with it) → build the app over a `KafkaBackend` → run it
with uvicorn. At startup the app migrates the database, seeds tenants and creates the admin token;
this module keeps ONE expiring API key for the demo tenant (`admin.demo_tenant`, see
`gateway/seed.py`), spawns the local workers (the worker secret reaches them through their
environment, never argv or a log) and prints a copy-paste curl. Secrets (a generated admin token,
a new demo key) go to the terminal when stdout is one; otherwise into 0600 files under var/,
never into a log. Ctrl-C / SIGTERM stop the workers (process groups, terminate then kill), the
gateway and the broker it started; workers also exit by themselves if `serve` is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from sluice.errors import CLIError
from sluice.settings import ModelSpec, Settings, load_settings

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
# A worker that ran this long before dying was healthy: its next restart starts the backoff over.
HEALTHY_RUN_S = 60.0


def restart_delay(restarts: int, uptime_s: float) -> tuple[float, int]:
    """(delay before the next start, the restart count after it) for a worker that died after
    `uptime_s` seconds with `restarts` restarts behind it."""
    if uptime_s >= HEALTHY_RUN_S:
        restarts = 0
    return RESTART_BACKOFF_S[min(restarts, len(RESTART_BACKOFF_S) - 1)], restarts + 1


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


@dataclass
class LocalWorkers:
    """The worker processes `serve` owns: spawned in their own process groups, restarted on death."""

    settings: Settings
    count: int
    device: str
    log_dir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _specs: dict[str, ModelSpec] = field(default_factory=dict)
    _restarts: dict[str, int] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)
    _stopping: bool = False
    _secret: str = ""

    def spawn_all(self, worker_port: int, secret: str) -> None:
        self._port = worker_port
        self._secret = secret
        for model in self.settings.models:
            for i in range(self.count):
                worker_id = f"local-{model.name}-{i}" if len(self.settings.models) > 1 else f"local-{i}"
                self._specs[worker_id] = model
                self._spawn(worker_id)

    def _spawn(self, worker_id: str) -> None:
        model = self._specs[worker_id]
        host = self.settings.gateway.worker_host
        args = [
            sys.executable,
            "-m",
            "sluice.cli",
            "worker",
            "--model",
            model.path,
            "--served-model-name",
            model.name,
            "--gateway",
            f"{host}:{self._port}",
            "--worker-id",
            worker_id,
            "--device",
            self.device,
            "--exit-with-parent",
        ]
        # The worker reads the same settings itself (the environment is inherited): [engine] included.
        config_dir = Path(self.settings.config_dir)
        if config_dir.is_dir():
            args += ["--config", str(config_dir.resolve())]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"worker-{worker_id}.log", "ab")  # noqa: SIM115
        try:
            self.processes[worker_id] = subprocess.Popen(
                args,
                env=self._worker_environment(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: we stop it (and anything it starts) as a whole
            )
        finally:
            out.close()
        self._started_at[worker_id] = time.monotonic()
        log.info("started worker %s (pid %d)", worker_id, self.processes[worker_id].pid)

    def _worker_environment(self) -> dict[str, str]:
        """CPU workers share the machine with the gateway: unless the operator chose a thread count,
        leave one core to the gateway and split the rest between the local workers (torch's
        default of every core per process made engine steps 10-60x slower under contention)."""
        env = {k: v for k, v in os.environ.items() if k != "SLUICE_ADMIN_TOKEN"}  # workers never need it
        env["SLUICE_GATEWAY_WORKER_SECRET"] = self._secret
        if self.device == "cpu" and "OMP_NUM_THREADS" not in env:
            workers = max(1, self.count * len(self.settings.models))
            env["OMP_NUM_THREADS"] = str(max(1, ((os.cpu_count() or 1) - 1) // workers))
        return env

    async def supervise(self) -> None:
        """Restarts a worker that died (with backoff), until `stop()`."""
        while not self._stopping:
            await asyncio.sleep(1.0)
            for worker_id, process in list(self.processes.items()):
                code = process.poll()
                if code is None or self._stopping:
                    continue
                uptime = time.monotonic() - self._started_at.get(worker_id, time.monotonic())
                delay, self._restarts[worker_id] = restart_delay(self._restarts.get(worker_id, 0), uptime)
                log.warning("worker %s exited with code %s after %.0fs; restarting in %.0fs (restart #%d)",
                            worker_id, code, uptime, delay, self._restarts[worker_id])
                await asyncio.sleep(delay)
                if not self._stopping:
                    self._spawn(worker_id)

    def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(grace_s)


def _resolve_settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(args.config)
    gateway = settings.gateway
    if args.host is not None:
        gateway = msgspec.structs.replace(gateway, host=args.host)
    if args.port is not None:
        if not 0 < args.port < 65536:
            raise CLIError(f"--port must be between 1 and 65535, got {args.port}")
        gateway = msgspec.structs.replace(gateway, port=args.port)
    dispatch = settings.dispatch
    if args.workers is not None:
        if args.workers < 0:
            raise CLIError(f"--workers must be zero or more, got {args.workers}")
        dispatch = msgspec.structs.replace(dispatch, local_workers=args.workers)
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


def _prepare_models(settings: Settings) -> None:
    from sluice.workers.demo import make_demo_model
    from sluice.workers.model.fetch import fetch_model

    for model in settings.models:
        path = Path(model.path)
        if (path / "config.json").is_file():
            continue
        if model.fetch is not None:
            print(f"fetching the model {model.name!r} into {path} (first run only; a few minutes) ...", flush=True)
            fetch_model(model.fetch, path)
            continue
        if not model.demo:
            raise CLIError(
                f"model {model.name!r}: directory {path} has no config.json; fix its path in models.toml"
            )
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


def _check_ports(settings: Settings) -> None:
    from sluice.broker import port_in_use

    gw = settings.gateway
    if port_in_use(gw.host, gw.port):
        raise CLIError(f"port {gw.port} on {gw.host} is already in use: stop what holds it or pass --port")
    if gw.worker_port and port_in_use(gw.worker_host, gw.worker_port):
        raise CLIError(
            f"the worker port {gw.worker_port} on {gw.worker_host} is already in use: "
            "set SLUICE_GATEWAY_WORKER_PORT to a free port"
        )


TRY_QUESTION = "What is the capital of France? Answer in one sentence."


def _curl(host: str, port: int, key: str, model: str, key_file: Path | None = None) -> str:
    # temperature 0: greedy, so the first answer a newcomer sees is the model's best one.
    body = json.dumps({"model": model, "stream": True, "max_tokens": 64, "temperature": 0,
                       "messages": [{"role": "user", "content": TRY_QUESTION}]})
    return (
        f"curl -N http://{host}:{port}/v1/chat/completions \\\n"
        f"  -H \"Authorization: Bearer {key if key_file is None else f'$(cat {key_file})'}\" "
        "-H 'Content-Type: application/json' \\\n"
        f"  -d '{body}'"
    )


def _openai_snippet(host: str, port: int, key: str, model: str, key_file: Path | None = None) -> str:
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


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after its shutdown, which would kill this process before
        it stops the broker and the workers; here a signal only asks the server to exit."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    _Server = _server_class()

    from sluice.broker import EmbeddedBroker
    from sluice.gateway.app import create_app
    from sluice.gateway.batches import batch_components
    from sluice.gateway.kafka_backend import KafkaBackend
    from sluice.gateway.seed import ensure_demo_key
    from sluice.gateway.shared import open_shared

    settings = _resolve_settings(args)
    check_engine_options(settings, args.device)
    _check_ports(settings)
    _prepare_models(settings)
    var = Path("var")
    broker: EmbeddedBroker | None = None
    if not settings.kafka.bootstrap_servers:
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
    workers = LocalWorkers(settings, settings.dispatch.local_workers, args.device, var / "logs")
    batches = batch_components(settings)
    shared = open_shared(settings.shared)
    backend = KafkaBackend(settings, batch_handler=batches.handler, shared=shared)
    gw = settings.gateway
    supervisor: list[asyncio.Task[None]] = []

    def announce(kind: str, value: str) -> None:
        if kind == "admin_token":
            print(reveal_secret("admin token (shown once, stored hashed)", value, var / "admin_token"),
                  flush=True)

    async def after_start(app: Any) -> None:
        batches.attach(app, backend)
        await batches.start()
        workers.spawn_all(backend.worker_port, backend.dispatcher.worker_secret)
        supervisor.append(asyncio.create_task(workers.supervise()))
        model = settings.models[0].name
        print(
            f"sluice gateway on http://{gw.host}:{gw.port} (workers connect to "
            f"{gw.worker_host}:{backend.worker_port}; {workers.count} local worker(s) per model)",
            flush=True,
        )
        demo_tenant = settings.admin.demo_tenant
        if not demo_tenant:
            return
        demo = await ensure_demo_key(app.state.admin, demo_tenant, ttl_days=settings.admin.demo_key_ttl_days,
                                     renew=bool(getattr(args, "new_demo_key", False)))
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
            print("try:\n" + _curl(gw.host, gw.port, demo.key, model, key_file), flush=True)
            print("or with the openai SDK:\n" + _openai_snippet(gw.host, gw.port, demo.key, model, key_file),
                  flush=True)

    async def before_stop(app: Any) -> None:
        for task in supervisor:
            task.cancel()
        await batches.stop()
        await asyncio.to_thread(workers.stop)

    app = create_app(
        settings,
        backend,
        extra_route_handlers=batches.route_handlers,
        on_startup=[after_start],
        on_shutdown=[before_stop],
        announce_secret=announce,
        shared=shared,
    )
    config = uvicorn.Config(
        app, host=gw.host, port=gw.port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5
    )
    server = _Server(config)
    try:
        server.run()
    finally:
        workers.stop()
        if broker is not None:
            broker.stop()
    if not server.started:
        raise CLIError("the gateway failed to start; see the messages above")
    return 0
