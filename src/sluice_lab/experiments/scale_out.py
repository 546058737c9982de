"""`sluice bench scale-out`: throughput and gateway overhead with 1, 2, 3... gateway replicas.

One run, the same load at every size: a closed loop of `--concurrency` streams (each sends its
next request when the last one ends), round-robin over the replicas, `--requests` short streaming
completions of the demo model, every worker linked to every replica (the same `--workers` at
every size, so only the number of replicas changes). Each size is a fresh cluster
(`sluice_lab.experiments.cluster`): its own PostgreSQL database, Redis key prefix and Kafka topics on
one embedded broker.

Per size: requests/s and output tokens/s over the loop's wall time, and the gateway overhead as
`sluice bench gateway-overhead` defines it: client-seen TTFT minus worker-seen TTFT (the replica's
record of dispatch -> the engine's first token), joined by request id, p50/p99, and its ratio to
the 1-replica run. On one machine the replicas share its cores with the workers, so expect
contention; the point is that nothing falls off a cliff as replicas are added.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from sluice.telemetry import percentile
from sluice_lab.experiments.cluster import Cluster, ClusterSpec, drop_redis_prefix, postgres_execute, start_cluster
from sluice_lab.experiments.common import ratio, resolve_model
from sluice_lab.loadgen.client import ClientResult, RequestSpec, send_streaming

PROMPT = "Once upon a time there was a small gateway that"


def _spec(index: int, key: str, max_tokens: int) -> RequestSpec:
    return RequestSpec(local_id=f"so-{index}", workload="scale-out", tenant="bench-scale-out", api_key=key,
                       prompt=PROMPT, max_tokens=max_tokens, service_tier=None, ignore_eos=True, temperature=0.0)


async def closed_loop(cluster: Cluster, key: str, *, concurrency: int, requests: int,
                      max_tokens: int) -> tuple[list[ClientResult], float]:
    """`concurrency` streams, each sending its next request when the last ends, the requests
    round-robin over the replicas; returns every result and the wall time."""
    counter = itertools.count()
    clients = [httpx.AsyncClient(base_url=r.base_url, timeout=300, limits=httpx.Limits(max_connections=None))
               for r in cluster.replicas]
    results: list[ClientResult] = []

    async def stream() -> None:
        while (index := next(counter)) < requests:
            client = clients[index % len(clients)]
            results.append(await send_streaming(client, _spec(index, key, max_tokens), model="demo",
                                                endpoint="completions"))

    start = time.monotonic()
    try:
        await asyncio.gather(*(stream() for _ in range(concurrency)))
    finally:
        for client in clients:
            await client.aclose()
    return results, time.monotonic() - start


def summarise(replicas: int, results: list[ClientResult], wall_s: float, cluster: Cluster) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    by_id = {record.request_id: record for record in cluster.records()}
    client_ttft, overhead = [], []
    for result in ok:
        record = by_id.get(result.request_id)
        if result.first_token is None:
            continue
        client_ttft.append(result.first_token - result.sent)
        if record is not None and record.engine_ttft_s is not None:
            overhead.append(result.first_token - result.sent - record.engine_ttft_s)
    output_tokens = sum(r.completion_tokens for r in ok)
    return {
        "replicas": replicas, "requests": len(results), "errors": len(results) - len(ok),
        "joined": len(overhead), "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "client_ttft_p50_s": percentile(client_ttft, 50), "client_ttft_p99_s": percentile(client_ttft, 99),
        "overhead_p50_s": percentile(overhead, 50), "overhead_p99_s": percentile(overhead, 99),
        "errors_by_type": {e: sum(1 for r in results if r.error == e) for e in {r.error for r in results if r.error}},
    }


def run_size(replicas: int, args: argparse.Namespace, model_dir: Path, bootstrap: str, workdir: Path) -> dict[str, Any]:
    """One fresh cluster of `replicas` replicas: warm up, then the closed loop."""
    name = f"sluice_bench_scaleout_{uuid.uuid4().hex[:8]}"
    asyncio.run(postgres_execute(args.postgres_url, f'CREATE DATABASE "{name}"'))
    base, _, _ = args.postgres_url.rpartition("/")
    prefix = f"sluice-bench-scaleout-{secrets.token_hex(4)}"
    spec = ClusterSpec(
        workdir=workdir / f"r{replicas}", model_dir=model_dir, bootstrap_servers=bootstrap,
        database_url=f"{base}/{name}".replace("postgresql://", "postgresql+asyncpg://", 1),
        shared_url=args.redis_url, shared_prefix=prefix, admin_token="slc-admin-" + secrets.token_urlsafe(24),
        worker_secret=secrets.token_urlsafe(24), replicas=replicas, workers=args.workers, lease_s=10.0,
        topic_prefix=f"bso{uuid.uuid4().hex[:8]}",
        worker_max_num_seqs=max(8, args.concurrency),
        # As gateway-overhead: no request waits for a free slot, so queueing is not counted as overhead.
        env=(("SLUICE_DISPATCH_MAX_WORKER_WAITING", str(max(2, args.concurrency))),))
    try:
        with start_cluster(spec) as cluster:
            _, _, key = cluster.new_tenant("bench-scale-out", priority_ceiling="interactive",
                                           default_class="interactive")
            warm = max(2 * replicas, 6)
            asyncio.run(closed_loop(cluster, key, concurrency=min(args.concurrency, warm), requests=warm,
                                    max_tokens=args.max_tokens))
            results, wall_s = asyncio.run(closed_loop(cluster, key, concurrency=args.concurrency,
                                                      requests=args.requests, max_tokens=args.max_tokens))
            time.sleep(1.0)  # records are written just after each stream ends
            return summarise(replicas, results, wall_s, cluster)
    finally:
        asyncio.run(drop_redis_prefix(args.redis_url, prefix))
        asyncio.run(postgres_execute(args.postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def run_scale_out(args: argparse.Namespace) -> dict[str, Any]:
    from sluice.broker import EmbeddedBroker

    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="sluice-scale-out-") as tmp:
        broker = EmbeddedBroker(log_path=Path(tmp) / "broker.log").start()
        try:
            sizes = [run_size(n, args, model_dir, broker.bootstrap_servers, Path(tmp)) for n in args.replicas]
        finally:
            broker.stop()
    baseline = next((s for s in sizes if s["replicas"] == 1), sizes[0])
    for size in sizes:
        for name in ("requests_per_s", "output_tokens_per_s", "overhead_p50_s", "overhead_p99_s"):
            size[f"{name}_vs_baseline"] = ratio(size[name], baseline[name])
    return {"model": str(model_dir), "workers": args.workers, "concurrency": args.concurrency,
            "requests": args.requests, "max_tokens": args.max_tokens, "baseline_replicas": baseline["replicas"],
            "sizes": sizes}


def format_table(summary: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    def num(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"{summary['requests']} requests, {summary['concurrency']} concurrent streams round-robin, "
             f"{summary['workers']} workers, max_tokens {summary['max_tokens']}",
             "replicas  req/s  out tok/s  client TTFT p50/p99 ms  overhead p50/p99 ms  overhead p50 vs 1  errors",
             ]
    for s in summary["sizes"]:
        lines.append(f"{s['replicas']:>8}  {num(s['requests_per_s']):>5}  {num(s['output_tokens_per_s']):>9}  "
                     f"{ms(s['client_ttft_p50_s']):>10} / {ms(s['client_ttft_p99_s']):<9}  "
                     f"{ms(s['overhead_p50_s']):>8} / {ms(s['overhead_p99_s']):<9}  "
                     f"{num(s['overhead_p50_s_vs_baseline'], 2):>16}  {s['errors']:>6}")
    return "\n".join(lines)


def run_scale_out_command(args: argparse.Namespace) -> int:
    from sluice.errors import CLIError
    from sluice_lab.cli import write_json

    if args.quick:
        args.requests, args.concurrency = 24, 4
    for flag in ("requests", "concurrency", "workers", "max_tokens"):
        if getattr(args, flag) < 1:
            raise CLIError(f"--{flag.replace('_', '-')} must be positive")
    if not args.postgres_url or not args.redis_url:
        raise CLIError("--postgres-url and --redis-url are needed (several replicas share one database and Redis)")
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    summary = run_scale_out(args)
    print(format_table(summary))
    write_json(args.json_out, summary)
    print(f"wrote {args.json_out}")
    return 0 if all(s["errors"] == 0 for s in summary["sizes"]) else 1
