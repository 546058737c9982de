"""`sluice bench chaos`: the cluster it runs on, and the figures of a run (`sluice_lab.experiments.chaos`).

The cluster is `sluice_lab.experiments.cluster` (real `sluice gateway` and `sluice worker` processes)
on an embedded broker, a fresh PostgreSQL database (several replicas cannot share a SQLite file)
and a fresh Redis key prefix, dropped afterwards. The figures: requests started and completed,
streams whose text differs from the undisturbed greedy reference, batch lines lost, duplicated or
divergent, per-stream stall (the longest gap between two consecutive events) and TTFT
percentiles, kills by kind and how long each victim took to serve again, reconnects.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import secrets
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from sluice.errors import CLIError
from sluice.telemetry import percentile
from sluice_lab.experiments.chaos import KINDS, ChaosConfig, ChaosOutcome, check_cluster_fits, run_chaos


def _dist(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values) if values else None}


def summarise(outcome: ChaosOutcome) -> dict[str, Any]:
    config, refs = outcome.config, outcome.references
    streams = outcome.streams
    completed = [s for s in streams if s.ok]
    divergent = [i for i, s in enumerate(streams) if s.ok and s.text != refs[s.prompt]]
    lines_expected = lines_got = lines_lost = lines_dup = lines_divergent = lines_failed = 0
    batches = []
    for run in outcome.batches:
        seen = Counter(custom_id for custom_id, _ in run.outputs)
        failed = [c for c, text in run.outputs if text is None]
        wrong = [c for c, text in run.outputs if text is not None and c in run.lines
                 and text != refs[run.lines[c]]]
        lost = sorted(set(run.lines) - set(seen))
        dup = sum(n - 1 for n in seen.values() if n > 1)
        foreign = sorted(set(seen) - set(run.lines))
        batches.append({"batch_id": run.batch_id, "status": run.status, "submitted_s": run.submitted_s,
                        "finished_s": run.finished_s, "lines": len(run.lines), "got": len(seen),
                        "lost": len(lost), "duplicated": dup, "failed": len(failed), "divergent": len(wrong),
                        "unexpected_ids": foreign[:20], "lost_ids": lost[:20], "divergent_ids": wrong[:20],
                        "failed_ids": failed[:20]})
        lines_expected += len(run.lines)
        lines_got += len(set(seen) & set(run.lines))
        lines_lost += len(lost)
        lines_dup += dup
        lines_divergent += len(wrong)
        lines_failed += len(failed)
    kills: list[dict[str, Any]] = [
        {"at_s": k.at_s, "kind": k.kind, "index": k.index, "pid": k.pid, "restarted_at_s": k.restarted_at_s,
         "serving_at_s": k.serving_at_s, "back_in_s": None if k.serving_at_s is None else k.serving_at_s - k.at_s,
         "error": k.error} for k in outcome.kills]
    started = len(streams) + lines_expected
    done = len(completed) + lines_got - lines_failed
    errors = Counter(s.error.split(":")[0] for s in streams if not s.ok)
    return {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": {"replicas": outcome.replicas, "workers": outcome.workers, "duration_s": config.duration_s,
                   "kill_every_s": config.kill_every_s, "kill": list(config.kinds), "streams": config.streams,
                   "batches": config.batches, "batch_lines": config.batch_lines, "prompts": config.prompts,
                   "max_tokens": config.max_tokens, "seed": config.seed,
                   "stream_replicas": config.stream_replicas or outcome.replicas},
        "chaos_s": outcome.chaos_s,
        "load_average_1m": {"start": outcome.load_average[0], "end": outcome.load_average[1]},
        "requests": {"started": started, "completed": done,
                     "completion_rate": done / started if started else None},
        "streams": {
            "started": len(streams), "completed": len(completed), "failed": len(streams) - len(completed),
            "errors_by_type": dict(errors),
            "failed_examples": [{"client": s.client, "prompt": s.prompt, "started_s": round(s.started_s, 2),
                                 "error": s.error} for s in streams if not s.ok][:10],
            "divergent": len(divergent),
            "divergent_examples": [{"stream": i, "prompt": streams[i].prompt, "got": streams[i].text[:200],
                                    "reference": refs[streams[i].prompt][:200]} for i in divergent[:10]],
            # Reconnects: every connection after a stream's first (a POST refused by a dead replica
            # and sent to the next one counts); re-attached: cut after events had come, and
            # attached again with Last-Event-ID (the stream a replica's SIGKILL broke midway).
            "reconnected": sum(1 for s in streams if s.connections > 1),
            "reconnects": sum(max(0, s.connections - 1) for s in streams),
            "reattached": sum(1 for s in streams if s.attaches),
            "reattached_stall_s": _dist([s.stall_s for s in streams if s.attaches and s.stall_s is not None]),
            "stall_s": _dist([s.stall_s for s in streams if s.stall_s is not None]),
            "ttft_s": _dist([s.ttft_s for s in streams if s.ttft_s is not None]),
        },
        "per_stream": [[s.client, s.prompt, round(s.started_s, 3), s.ended_s and round(s.ended_s, 3), s.ok,
                        s.connections, s.attaches, s.stall_s and round(s.stall_s, 4), s.ttft_s and round(s.ttft_s, 4)]
                       for s in streams],
        "per_stream_fields": ["client", "prompt", "started_s", "ended_s", "ok", "connections", "attaches", "stall_s",
                              "ttft_s"],
        "batch_lines": {"expected": lines_expected, "got": lines_got, "lost": lines_lost, "duplicated": lines_dup,
                        "failed": lines_failed, "divergent": lines_divergent, "batches": batches},
        "kills": {"total": len(kills), "by_kind": dict(Counter(k["kind"] for k in kills)),
                  "skipped": outcome.kills_skipped,
                  "restart_errors": sum(1 for k in kills if k["error"]),
                  "back_in_s": {kind: _dist([k["back_in_s"] for k in kills if k["kind"] == kind
                                            and k["back_in_s"] is not None]) for kind in KINDS},
                  "list": kills},
    }


def passed(summary: dict[str, Any]) -> bool:
    """The acceptance: every request completed, no divergent text, no line lost or duplicated."""
    s, b = summary["streams"], summary["batch_lines"]
    return (summary["requests"]["completed"] == summary["requests"]["started"] and s["divergent"] == 0
            and b["lost"] == 0 and b["duplicated"] == 0 and b["divergent"] == 0 and b["failed"] == 0)


def format_table(summary: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:,.0f}"

    c, r, s, b, k = (summary[x] for x in ("config", "requests", "streams", "batch_lines", "kills"))
    rate = r["completion_rate"]
    back = "  ".join(f"{kind} back in p50 {ms(d['p50'])} / max {ms(d['max'])} ms"
                     for kind, d in k["back_in_s"].items() if d["max"] is not None)
    return "\n".join([
        f"chaos: {c['replicas']} replicas, {c['workers']} workers, {c['duration_s']:g} s, a {'/'.join(c['kill'])} "
        f"SIGKILLed every {c['kill_every_s']:g} s; {c['streams']} streaming clients, {c['batches']} x "
        f"{c['batch_lines']} batch lines, max_tokens {c['max_tokens']}; load average "
        f"{summary['load_average_1m']['start']:.1f} -> {summary['load_average_1m']['end']:.1f}",
        f"requests   started {r['started']}  completed {r['completed']}  "
        f"rate {'-' if rate is None else f'{100 * rate:.2f}%'}",
        f"streams    {s['completed']}/{s['started']} completed, {s['divergent']} divergent from the reference, "
        f"{s['reconnected']} reconnected ({s['reconnects']} reconnects), {s['reattached']} re-attached midway "
        f"(their stall max {ms(s['reattached_stall_s']['max'])} ms)"
        + (f", failures {s['errors_by_type']}" if s["failed"] else ""),
        f"stall ms   p50 {ms(s['stall_s']['p50'])}  p99 {ms(s['stall_s']['p99'])}  max {ms(s['stall_s']['max'])}"
        f"   (TTFT p50 {ms(s['ttft_s']['p50'])}  p99 {ms(s['ttft_s']['p99'])}  max {ms(s['ttft_s']['max'])})",
        f"batch      {b['got']}/{b['expected']} lines, {b['lost']} lost, {b['duplicated']} duplicated, "
        f"{b['failed']} failed, {b['divergent']} divergent",
        f"kills      {k['total']} ({', '.join(f'{n} {kind}' for kind, n in sorted(k['by_kind'].items())) or 'none'}); "
        f"{k['skipped']} skipped (none to spare), {k['restart_errors']} restart errors; {back}",
        f"verdict    {'PASS' if passed(summary) else 'FAIL'}",
    ])


def parse_kinds(text: str) -> tuple[str, ...]:
    if text.strip() == "none":
        return ()
    kinds = tuple(sorted({k.strip().rstrip("s") for k in text.split(",") if k.strip()}))
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"--kill takes a comma-separated list of replicas, workers (or none); got {text!r}")
    return kinds


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    config = ChaosConfig(duration_s=args.duration_s, kill_every_s=args.kill_every_s, kinds=parse_kinds(args.kill),
                         streams=args.streams, batches=args.batches, batch_lines=args.batch_lines,
                         prompts=args.prompts, max_tokens=args.max_tokens, seed=args.seed,
                         stream_replicas=args.stream_replicas)
    for flag in ("replicas", "workers"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be positive, got {getattr(args, flag)}")
    check_cluster_fits(config, args.replicas, args.workers)
    return config


def _keep_logs(workdir: Path, to: Path) -> None:
    """Every replica's and worker's log (all their restarts appended), kept past the temp dir."""
    import shutil

    to.mkdir(parents=True, exist_ok=True)
    for log in workdir.glob("*.log"):
        shutil.copy2(log, to / log.name)
    print(f"logs kept in {to}")


def run_chaos_command(args: argparse.Namespace) -> int:
    from sluice.broker import EmbeddedBroker
    from sluice_lab.cli import write_json
    from sluice_lab.experiments.cluster import ClusterSpec, drop_redis_prefix, postgres_execute, start_cluster
    from sluice_lab.experiments.common import resolve_model

    config = config_from_args(args)  # garbage flags fail here, before anything starts
    if not args.postgres_url:
        raise CLIError("--postgres-url is needed: the replicas share one database (a SQLite file cannot be "
                       "shared by several processes), e.g. postgresql://postgres@127.0.0.1:5432/postgres")
    if not args.redis_url.startswith(("redis://", "rediss://")):
        raise CLIError(f"--redis-url must be a redis:// or rediss:// URL, got {args.redis_url.split('@')[-1]!r}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    model_dir = resolve_model(args.model)
    name = f"sluice_bench_chaos_{uuid.uuid4().hex[:8]}"
    asyncio.run(postgres_execute(args.postgres_url, f'CREATE DATABASE "{name}"'))
    base, _, _ = args.postgres_url.rpartition("/")
    prefix = f"sluice-bench-chaos-{secrets.token_hex(4)}"
    try:
        with tempfile.TemporaryDirectory(prefix="sluice-chaos-") as tmp:
            broker = EmbeddedBroker(log_path=Path(tmp) / "broker.log").start()
            try:
                spec = ClusterSpec(
                    workdir=Path(tmp) / "cluster", model_dir=model_dir, bootstrap_servers=broker.bootstrap_servers,
                    database_url=f"{base}/{name}".replace("postgresql://", "postgresql+asyncpg://", 1),
                    shared_url=args.redis_url, shared_prefix=prefix,
                    admin_token="slc-admin-" + secrets.token_urlsafe(24), worker_secret=secrets.token_urlsafe(24),
                    replicas=args.replicas, workers=args.workers, lease_s=2.0,
                    topic_prefix=f"chaos{uuid.uuid4().hex[:8]}", worker_max_num_seqs=max(8, args.streams),
                    # As the scale-out tests: a dead member's partitions move in ~5 s, not ~10 s.
                    env=(("SLUICE_KAFKA_SESSION_TIMEOUT_MS", "3000"), ("SLUICE_KAFKA_HEARTBEAT_INTERVAL_MS", "1000")))
                with start_cluster(spec) as cluster:
                    stream_key = cluster.new_tenant("chaos-streams", priority_ceiling="interactive",
                                                    default_class="interactive")[2]
                    batch_key = cluster.new_tenant("chaos-batch", priority_ceiling="batch", default_class="batch")[2]
                    try:
                        outcome = run_chaos(cluster, stream_key, batch_key, config)
                    finally:
                        if args.logs:
                            _keep_logs(Path(tmp) / "cluster", Path(args.logs))
            finally:
                broker.stop()
    finally:
        asyncio.run(drop_redis_prefix(args.redis_url, prefix))
        asyncio.run(postgres_execute(args.postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    summary = summarise(outcome)
    print(format_table(summary))
    write_json(args.json_out, summary)
    print(f"wrote {args.json_out}")
    return 0 if passed(summary) else 1
