"""`sluice bench engine|serve|policies|chunk-sweep|isolation|gateway-overhead|scale-out|chaos`: argument parsing only.

Each handler imports its implementation lazily, so `sluice --help` stays fast and an area's
heavy imports (torch, matplotlib) load only for the command that needs them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path

from sluice.errors import CLIError

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:
    from sluice.workers.cli import add_engine_arguments
    from sluice_lab.engine_bench import add_arguments, run_bench

    engine = bench_subparsers.add_parser("engine", help="sluice policies vs HF static batching, one process")
    add_arguments(engine)
    add_engine_arguments(engine, with_policy=False)
    engine.set_defaults(handler=run_bench)

    from sluice_lab.structured_bench import add_arguments as add_structured_arguments
    from sluice_lab.structured_bench import run_structured

    structured = bench_subparsers.add_parser(
        "structured", help="output tok/s at 0/50/100%% constrained by a nested JSON Schema; mask and compile costs")
    add_structured_arguments(structured)
    add_engine_arguments(structured)
    structured.set_defaults(handler=run_structured)

    serve = bench_subparsers.add_parser(
        "serve", help="replay a scenario against an OpenAI-compatible server (sluice, vLLM, ...)")
    serve.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    serve.add_argument("--scenario", required=True,
                       help="TOML file, or the name of one in src/sluice_lab/scenarios (chat, rag, mixed, ...)")
    serve.add_argument("--json", dest="json_out", help="write the full report (with per-request data) here")
    serve.add_argument("--plot", help="write a PNG of latency CDFs and throughput here")
    serve.add_argument("--slo", help="override the scenario's SLO, e.g. ttft=3s,itl=300ms")
    serve.add_argument("--seed", type=int, help="override the scenario's seed")
    serve.add_argument("--duration-s", type=float, help="override the scenario's duration_s")
    serve.add_argument("--max-requests", type=int, help="override the scenario's max_requests")
    serve.add_argument("--tokenizer", help="model dir whose tokenizer calibrates synthetic prompt lengths")
    serve.add_argument("--request-timeout-s", type=float, default=600.0)
    serve.add_argument("--no-progress", action="store_true", help="no progress bar even on a TTY")
    serve.add_argument("--reconnects", type=int, default=0,
                       help="re-attach a broken stream up to this many times (Last-Event-ID; sluice's "
                            "resumable streams, docs/streams.md); 0 = a broken stream is an error")
    serve.set_defaults(handler=_serve)

    from sluice_lab.experiments import cli as experiments_cli

    experiments_cli.register(bench_subparsers)


def resolve_scenario(value: str) -> Path:
    path = Path(value)
    if path.is_file():
        return path
    named = SCENARIO_DIR / (value if value.endswith(".toml") else f"{value}.toml")
    if named.is_file():
        return named
    raise CLIError(f"--scenario: no file {value!r} and no scenario of that name in {SCENARIO_DIR}")


def write_json(path: str | Path, data: object) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _serve(args: argparse.Namespace) -> int:
    from sluice_lab.loadgen.report import build_report, format_table
    from sluice_lab.loadgen.runner import run_scenario
    from sluice_lab.loadgen.scenario import Slo, load_scenario

    scenario = load_scenario(resolve_scenario(args.scenario))
    if args.tokenizer:
        scenario = dataclasses.replace(scenario, tokenizer=args.tokenizer)
    slo = Slo.parse(args.slo) if args.slo else scenario.slo
    if args.duration_s is not None and args.duration_s <= 0:
        raise CLIError("--duration-s must be positive")
    if args.max_requests is not None and args.max_requests < 0:
        raise CLIError("--max-requests must be 0 (no cap) or positive")
    if not 0 <= args.reconnects <= 100:
        raise CLIError("--reconnects must be between 0 and 100")
    seed = scenario.seed if args.seed is None else args.seed
    run = asyncio.run(run_scenario(
        scenario, args.base_url, seed=seed, duration_s=args.duration_s, max_requests=args.max_requests,
        request_timeout_s=args.request_timeout_s, progress=False if args.no_progress else None,
        reconnects=args.reconnects))
    report = build_report(run, scenario, slo, seed)
    print(format_table(report))
    if args.json_out:
        write_json(args.json_out, report)
    if args.plot:
        from sluice_lab.loadgen.plot import plot_report

        plot_report(report, args.plot)
    summary = report["summary"]
    # Exit 1 when nothing succeeded: a misconfigured URL or key should fail a CI step.
    return 0 if summary["succeeded"] or not summary["requests"] else 1
