"""`sluice serve` (gateway + broker + local workers, or a local cluster with --replicas), `sluice
gateway` (one replica of a cluster) and `sluice worker` (one engine process serving every replica)."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.errors import CLIError

if TYPE_CHECKING:
    from sluice.workers.config import EngineConfig
    from sluice.workers.server import WorkerOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    from sluice.workers.cli import add_engine_arguments

    serve = subparsers.add_parser(
        "serve", help="run the gateway, the embedded broker (unless Kafka is configured) and local workers"
    )
    serve.add_argument("--host", default=None, help="HTTP listen address (default: settings, 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="HTTP port (default: settings, 8000)")
    serve.add_argument(
        "--workers",
        default=None,
        help="local worker processes per model (default: settings.dispatch.local_workers); "
        "with --replicas each is linked to every replica",
    )
    serve.add_argument(
        "--replicas",
        default=None,
        help="run a local trial cluster of this many `sluice gateway` processes on consecutive HTTP and "
        "worker ports (needs [shared] url / SLUICE_SHARED_URL when more than 1; default 1: one process)",
    )
    serve.add_argument(
        "--model",
        default=None,
        help="serve this model directory only (named after the directory) instead of models.toml",
    )
    serve.add_argument(
        "--demo",
        action="store_true",
        help="serve only the demo models of models.toml (tiny, random weights, no download) instead of the real ones",
    )
    serve.add_argument(
        "--config", default=None, help="config directory (default: $SLUICE_CONFIG_DIR or ./config)"
    )
    serve.add_argument("--device", default="cpu", help="device of the local workers: cpu, cuda or cuda:N")
    serve.add_argument("--new-demo-key", action="store_true",
                       help="revoke the demo tenant's key and create a new one (shown once)")
    serve.set_defaults(handler=_serve)

    gateway = subparsers.add_parser(
        "gateway", help="run one gateway replica: no local workers, no embedded broker (needs Kafka "
        "and the worker secret configured)")
    gateway.add_argument("--host", default=None, help="HTTP listen address (default: settings, 127.0.0.1)")
    gateway.add_argument("--port", type=int, default=None, help="HTTP port (default: settings, 8000)")
    gateway.add_argument("--worker-port", type=int, default=None,
                         help="where workers connect (default: settings, 8100; 0 = any free port)")
    gateway.add_argument(
        "--config", default=None, help="config directory (default: $SLUICE_CONFIG_DIR or ./config)"
    )
    gateway.add_argument("--model", default=None,
                         help="serve this model directory only (named after the directory) instead of models.toml")
    gateway.add_argument("--demo", action="store_true", help="serve only the demo models of models.toml")
    gateway.add_argument("--exit-with-parent", action="store_true",
                         help="exit when the process that started this gateway dies (used by `sluice serve`)")
    gateway.set_defaults(handler=_gateway)

    worker = subparsers.add_parser("worker", help="run one engine and serve it to a gateway")
    worker.add_argument("--model", required=True, help="local Hugging Face model directory")
    worker.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: the directory's name)"
    )
    worker.add_argument("--gateway", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                        help="the worker address of every gateway replica to serve (one connection each)")
    worker.add_argument("--worker-id", default=None, help="default: HOSTNAME-PID")
    worker.add_argument("--heartbeat-interval", type=float, default=None,
                        help="seconds between heartbeats (default: [dispatch] heartbeat_interval_s)")
    worker.add_argument(
        "--config", default=None, help="config directory (default: $SLUICE_CONFIG_DIR or ./config)"
    )
    worker.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any EngineConfig field (e.g. kv_cache_bytes=268435456); repeatable, "
        "applied over [engine] settings and the flags; values are TOML literals",
    )
    worker.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="exit when the process that started this worker dies (used by `sluice serve`)",
    )
    add_engine_arguments(worker)
    worker.set_defaults(handler=_worker)


def _worker(args: argparse.Namespace) -> int:
    from sluice.workers.server import run_worker

    run_worker(*worker_setup(args))
    return 0


def worker_setup(args: argparse.Namespace) -> tuple[EngineConfig, WorkerOptions]:
    """`sluice worker`'s engine and link settings: EngineConfig's defaults, then [engine] settings
    (files and SLUICE_ENGINE_*), then the engine flags, then --engine-option."""
    from sluice.settings import load_settings
    from sluice.workers.cli import engine_config
    from sluice.workers.server import WorkerOptions, parse_gateways

    try:
        gateways = parse_gateways(args.gateway)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    # The same settings as `sluice serve` (files and SLUICE_* environment): [engine] under the flags.
    settings = load_settings(args.config)
    gateway = settings.gateway
    heartbeat = settings.dispatch.heartbeat_interval_s if args.heartbeat_interval is None else args.heartbeat_interval
    if heartbeat <= 0:
        raise CLIError(f"--heartbeat-interval must be positive, got {heartbeat}")
    model_dir = Path(args.model)
    config = apply_engine_options(engine_config(args, str(model_dir), settings=settings.engine), args.engine_option)
    options = WorkerOptions(
        gateways=gateways,
        worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        model_name=args.served_model_name or model_dir.resolve().name,
        heartbeat_interval_s=heartbeat,
        parent_pid=os.getppid() if args.exit_with_parent else None,
        # From settings (environment included), never from argv: `ps` shows the command line.
        secret=gateway.worker_secret,
        tls_ca=gateway.worker_tls_ca,
        tracing=settings.tracing,
    )
    if not options.secret:
        raise CLIError("no worker secret: set SLUICE_GATEWAY_WORKER_SECRET (or [gateway] worker_secret) "
                       "to the gateway's value")
    return config, options


def apply_engine_options(config: EngineConfig, options: list[str]) -> EngineConfig:
    """Overlays KEY=VALUE engine options (TOML literals, else strings) on an EngineConfig."""
    import dataclasses
    import tomllib

    fields = {f.name for f in dataclasses.fields(config)}
    changes: dict[str, Any] = {}
    for option in options:
        key, sep, raw = option.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise CLIError(f"--engine-option expects KEY=VALUE, got {option!r}")
        if key not in fields or key == "model":
            raise CLIError(
                f"--engine-option: unknown engine setting {key!r}; known: {', '.join(sorted(fields))}"
            )
        try:
            changes[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            changes[key] = raw
    return dataclasses.replace(config, **changes) if changes else config


def _serve(args: argparse.Namespace) -> int:
    from sluice.gateway.launch.serve import serve

    return serve(args)


def _gateway(args: argparse.Namespace) -> int:
    from sluice.gateway.launch.serve import gateway

    return gateway(args)
