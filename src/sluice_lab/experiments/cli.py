"""Argument parsing for the experiment subcommands of `sluice bench`."""

from __future__ import annotations

import argparse


def positive_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _common(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--json", dest="json_out", default=f"{name}.json", help="JSON summary path")
    parser.add_argument("--plot", default=f"{name}.png", help="PNG plot path")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    parser.add_argument("--seed", type=int, default=0)


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the demo model, built in a cache dir)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads on CPU (default 1: reproducible on a shared machine)")


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    libs = bench_subparsers.add_parser(
        "grammar-libs", help="llguidance vs xgrammar: nested-schema compile time, per-step mask cost")
    libs.add_argument("--model", required=True, help="model directory whose tokenizer to use (e.g. SmolLM2)")
    libs.add_argument("--rows", type=positive_int_list, default=[1, 16, 64], help="constrained rows per step")
    libs.add_argument("--steps", type=int, default=20, help="mask steps per round and row count")
    libs.add_argument("--rounds", type=int, default=3, help="interleaved rounds (a fresh schema each)")
    libs.add_argument("--json", dest="json_out", default="grammar-libs.json", help="JSON summary path")
    libs.set_defaults(handler=_grammar_libs)

    policies = bench_subparsers.add_parser(
        "policies", help="static vs prefill_first vs chunked: a long prompt arrives while streams decode")
    _engine_args(policies)
    policies.add_argument("--streams", type=int, help="decoding streams (default 8; 4 with --quick)")
    policies.add_argument("--long-prompt", type=int, help="long prompt tokens (default: fits max_model_len)")
    policies.add_argument("--chunk", type=int, help="chunked policy's prefill chunk (default 256; 64 quick)")
    _common(policies, "policies")
    policies.set_defaults(handler=_policies)

    sweep = bench_subparsers.add_parser(
        "chunk-sweep", help="chunked prefill: TTFT/ITL trade-off per chunk size, recommended chunk")
    sweep.add_argument("--chunks", type=positive_int_list, default=[64, 128, 256, 512, 1024])
    _engine_args(sweep)
    # Tight enough for the CPU demo model that chunk sizes differ in goodput; on a GPU with a real
    # model pass the service's own SLO (e.g. the chat scenario's ttft=3s,itl=300ms).
    sweep.add_argument("--slo", default="ttft=500ms,itl=25ms", help="SLO for goodput, e.g. ttft=3s,itl=300ms")
    sweep.add_argument("--duration-s", type=float, help="arrival window per chunk size (default 20; 2 quick)")
    sweep.add_argument("--rate", type=float, help="requests/s (Poisson; default 2.0)")
    _common(sweep, "chunk-sweep")
    sweep.set_defaults(handler=_chunk_sweep)

    slo = bench_subparsers.add_parser(
        "slo", help="fixed chunk sizes vs the adaptive chunk policy on a phased load (goodput, ITL, TTFT)")
    slo.add_argument("--chunks", type=positive_int_list, default=[64, 128, 256, 512, 1024, 2048])
    _engine_args(slo)
    slo.add_argument("--slo", default="ttft=3s,itl=300ms",
                     help="interactive targets (standard: 10/3 of them, batch none), e.g. ttft=3s,itl=300ms")
    slo.add_argument("--phases", nargs="+", help="steady long_while_decoding batch_flood burst (default: all)")
    slo.add_argument("--load", choices=("cpu", "gpu"), default="cpu",
                     help="the phases' sizes: cpu (a small model on a CPU) or gpu (an 8B shape on an H200)")
    slo.add_argument("--workload", choices=("chat", "random"), default="chat",
                     help="chat: the shipped conversations (retrieval-style where a phase wants longer prompts), "
                          "sampled (temperature 0.8, top_p 0.95); random: random token ids, greedy (the original)")
    _common(slo, "slo")
    slo.set_defaults(handler=_slo)

    isolation = bench_subparsers.add_parser(
        "isolation", help="interactive TTFT p95 with/without a batch flood, priority on/off (full stack)")
    isolation.add_argument("--flood", type=int, default=2000, help="batch lines in the flood")
    isolation.add_argument("--interactive-requests", type=int, help="interactive requests per arm")
    isolation.add_argument("--model", help="model directory for the stack (default: the demo model)")
    isolation.add_argument("--config-dir", default="config", help="config dir to copy (default ./config)")
    _common(isolation, "isolation")
    isolation.set_defaults(handler=_isolation)

    overhead = bench_subparsers.add_parser(
        "gateway-overhead", help="client-seen minus worker-seen TTFT at given concurrencies (full stack)")
    overhead.add_argument("--concurrency", type=positive_int_list,
                          help="levels (default 50,200; with --upstream 1,50,200)")
    overhead.add_argument("--requests-per-level", type=int, help="requests per concurrency level")
    overhead.add_argument("--model", help="model directory (with --upstream: only its tokenizer is used)")
    overhead.add_argument("--config-dir", default="config")
    side = overhead.add_argument_group(
        "side by side (--upstream)", "direct to a fake OpenAI backend vs through sluice vs through peers")
    side.add_argument("--upstream", choices=["fake"],
                      help="measure sluice in front of src/sluice_lab/fake_openai.py instead of its own worker")
    side.add_argument("--vs", default="", help="peers to run in the same session: litellm")
    side.add_argument("--no-sluice", action="store_true", help="only direct and the --vs peers")
    side.add_argument("--saturation-streams", type=int, help="closed-loop streams of the saturation run (512)")
    side.add_argument("--saturation-s", type=float, help="length of the saturation run (12 s)")
    side.add_argument("--fake-ttft-ms", type=float, default=50.0)
    side.add_argument("--fake-itl-ms", type=float, default=20.0)
    side.add_argument("--fake-tokens", type=int, default=32)
    side.add_argument("--ramp-s", type=float,
                      help="start each level's streams evenly over this many seconds (default: one request's "
                           "length at the fake's timing; 0: all at once). Levels above 1 also run all at once")
    side.add_argument("--nice", type=int, default=0,
                      help="niceness of every bench process alike (negative on a busy shared machine, as root)")
    _common(overhead, "gateway-overhead")
    overhead.set_defaults(handler=_gateway_overhead)

    scale = bench_subparsers.add_parser(
        "scale-out", help="throughput and gateway overhead with 1, 2, 3 gateway replicas (one run, same load)")
    scale.add_argument("--replicas", type=positive_int_list, default=[1, 2, 3], help="cluster sizes, e.g. 1,2,3")
    scale.add_argument("--workers", type=int, default=2, help="worker processes, linked to every replica")
    scale.add_argument("--concurrency", type=int, default=16, help="closed-loop streams, round-robin")
    scale.add_argument("--requests", type=int, default=300, help="requests per cluster size")
    scale.add_argument("--max-tokens", type=int, default=16)
    scale.add_argument("--model", help="model directory (default: the demo model)")
    scale.add_argument("--postgres-url", default="", help="PostgreSQL server URL; a database is made per size")
    scale.add_argument("--redis-url", default="", help="Redis URL; a key prefix is used per size")
    scale.add_argument("--json", dest="json_out", default="scale-out.json", help="JSON summary path")
    scale.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    scale.set_defaults(handler=_scale_out)

    parity = bench_subparsers.add_parser(
        "upstream-parity", help="a real vLLM server direct vs behind sluice, by `vllm bench serve` (issue #35)")
    from sluice_lab.experiments.vllm_parity import add_arguments as parity_arguments
    from sluice_lab.experiments.vllm_parity import run_parity_command

    parity_arguments(parity)
    parity.set_defaults(handler=run_parity_command)

    routing = bench_subparsers.add_parser(
        "routing", help="least_loaded vs round_robin vs cache_aware routing on worker processes (issue #33)")
    from sluice_lab.experiments.routing import add_arguments as routing_arguments

    routing_arguments(routing)
    routing.set_defaults(handler=_routing)

    replay = bench_subparsers.add_parser(
        "routing-replay", help="a routing run's arrivals through the router against modelled workers, in seconds")
    from sluice_lab.experiments.routing_replay import add_arguments as replay_arguments

    replay_arguments(replay)
    replay.set_defaults(handler=_routing_replay)

    chaos = bench_subparsers.add_parser(
        "chaos", help="mixed streaming and batch load while replicas and workers are SIGKILLed (issue #16)")
    chaos.add_argument("--replicas", type=int, default=3, help="gateway replica processes")
    chaos.add_argument("--workers", type=int, default=2, help="worker processes, linked to every replica")
    chaos.add_argument("--duration-s", type=float, default=300.0, help="length of the chaos")
    chaos.add_argument("--kill-every-s", type=float, default=8.0, help="a SIGKILL every this many seconds")
    chaos.add_argument("--kill", default="replicas,workers",
                       help="what is killed, in turns: replicas, workers or both (comma-separated)")
    chaos.add_argument("--streams", type=int, default=8, help="concurrent streaming clients")
    chaos.add_argument("--batches", type=int, default=1, help="Batch API batches, submitted at even times")
    chaos.add_argument("--batch-lines", type=int, default=200, help="lines per batch")
    chaos.add_argument("--prompts", type=int, default=8, help="distinct prompts (one greedy reference each)")
    chaos.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (ignore_eos)")
    chaos.add_argument("--seed", type=int, default=0, help="the kills' and the prompts' random choices")
    chaos.add_argument("--stream-replicas", type=int, default=0,
                       help="streams go to the first N replicas only, which are never killed (0: all replicas)")
    chaos.add_argument("--model", help="model directory (default: the demo model)")
    chaos.add_argument("--postgres-url", default="", help="PostgreSQL server URL; a fresh database is made")
    chaos.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                       help="Redis URL; a fresh key prefix is used and dropped")
    chaos.add_argument("--logs", help="keep every replica's and worker's log in this directory")
    chaos.add_argument("--out", "--json", dest="json_out", default="chaos.json", help="JSON summary path")
    chaos.set_defaults(handler=_chaos)


def _grammar_libs(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from sluice_lab.experiments.grammar_libs import run

    report = run(Path(args.model), args.rows, args.steps, args.rounds, Path(args.json_out))
    print(json.dumps(report["libraries"], indent=2))
    return 0


def _policies(args: argparse.Namespace) -> int:
    from sluice_lab.experiments.policies import run_policies_command

    return run_policies_command(args)


def _chunk_sweep(args: argparse.Namespace) -> int:
    from sluice_lab.experiments.chunk_sweep import run_chunk_sweep_command

    return run_chunk_sweep_command(args)


def _slo(args: argparse.Namespace) -> int:
    from sluice_lab.experiments.slo_bench import run_slo_command

    return run_slo_command(args)


def _isolation(args: argparse.Namespace) -> int:
    from sluice_lab.experiments.isolation import run_isolation_command

    return run_isolation_command(args)


def _scale_out(args: argparse.Namespace) -> int:
    from sluice_lab.experiments.scale_out import run_scale_out_command

    return run_scale_out_command(args)


def _routing(args: argparse.Namespace) -> int:
    from sluice_lab.experiments.routing import run_routing_command

    return run_routing_command(args)


def _routing_replay(args: argparse.Namespace) -> int:
    from sluice_lab.experiments.routing_replay import run_replay_command

    return run_replay_command(args)


def _chaos(args: argparse.Namespace) -> int:
    from sluice_lab.experiments.chaos_report import run_chaos_command

    return run_chaos_command(args)


def _gateway_overhead(args: argparse.Namespace) -> int:
    if args.upstream:
        from sluice_lab.experiments.upstream_overhead import run_upstream_overhead_command

        return run_upstream_overhead_command(args)
    from sluice.errors import CLIError
    from sluice_lab.experiments.gateway_overhead import run_gateway_overhead_command

    if args.vs or args.no_sluice:
        raise CLIError("--vs and --no-sluice need --upstream fake")
    args.concurrency = args.concurrency or [50, 200]

    return run_gateway_overhead_command(args)
