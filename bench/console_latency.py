"""The admin console's update latency under load: 50 tenants, 200 concurrent streams.

Against a running gateway (`sluice serve`, with its admin token): creates the tenants (once) and a
key each, keeps `--streams` streaming chat completions in flight spread over them, signs in to the
console and refreshes its live page the way the browser does: every 2 s one `GET /console/live`,
which answers every section (queues, workers, charts, batches, events) at once. One "update" is
that request, until its last byte; `GET /health` alongside is the baseline (what any answer costs
on the loaded gateway).
The streams run in a child process, so the measuring client's own event loop is not the one
serving 200 streams. Prints p50/p95/max per fragment and per update and writes them as JSON.
Bounded: it stops after `--duration-s`.

    python bench/console_latency.py --base-url http://127.0.0.1:8000 --admin-token "$ADMIN" \
        --json docs/lab/results/console_latency.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

PATHS = {"update": "/console/live", "health": "/health"}


def percentile(values: list[float], q: float) -> float:
    from sluice.telemetry import percentile as p

    result = p(values, q)
    return float("nan") if result is None else result


async def tenant_keys(client: httpx.AsyncClient, admin: dict[str, str], count: int) -> list[str]:
    existing = {t["name"]: t["id"] for t in (await client.get("/admin/tenants", headers=admin)).json()["data"]}
    keys = []
    for i in range(count):
        name = f"bench-console-{i:02d}"
        if name not in existing:
            created = await client.post("/admin/tenants", headers=admin, json={"name": name})
            created.raise_for_status()
            existing[name] = created.json()["id"]
        key = await client.post(f"/admin/tenants/{existing[name]}/keys", headers=admin, json={"name": "bench"})
        key.raise_for_status()
        keys.append(key.json()["key"])
    return keys


async def sign_in(client: httpx.AsyncClient, token: str) -> None:
    form = await client.get("/console/login")
    nonce = re.search(r'name="nonce" value="([^"]+)"', form.text)
    if nonce is None:
        raise SystemExit("no sign-in form at /console/login")
    answer = await client.post("/console/login", data={"token": token, "nonce": nonce.group(1)})
    if answer.status_code != 303:
        raise SystemExit(f"console sign-in failed ({answer.status_code}): is the admin token right?")


async def stream_forever(client: httpx.AsyncClient, key: str, model: str, max_tokens: int, until: float,
                         counts: dict[str, int]) -> None:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Summarise the quarterly report in three points."}]}
    while time.monotonic() < until:
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body,
                                     headers={"authorization": f"Bearer {key}"}) as answer:
                async for _ in answer.aiter_lines():
                    pass
            counts[str(answer.status_code)] = counts.get(str(answer.status_code), 0) + 1
        except httpx.HTTPError as exc:
            counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1


async def refresh_loop(console: httpx.AsyncClient, until: float, interval_s: float,
                       timings: dict[str, list[float]], sizes: list[int]) -> None:
    async def one(name: str) -> None:
        start = time.perf_counter()
        answer = await console.get(PATHS[name], headers={"hx-request": "true"})
        answer.raise_for_status()
        timings[name].append(time.perf_counter() - start)
        if name == "update":
            sizes.append(len(answer.content))

    while time.monotonic() < until:
        start = time.perf_counter()
        await asyncio.gather(*(one(name) for name in PATHS))
        await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - start)))


async def run_load(base_url: str, keys: list[str], model: str, streams: int, max_tokens: int,
                   duration_s: float) -> dict[str, int]:
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    counts: dict[str, int] = {}
    until = time.monotonic() + duration_s
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(stream_forever(client, keys[i % len(keys)], model, max_tokens, until, counts)
                               for i in range(streams)))
    return counts


def _load_process(args: tuple[Any, ...], out: Any) -> None:
    out.put(asyncio.run(run_load(*args)))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    admin = {"authorization": f"Bearer {args.admin_token}"}
    async with httpx.AsyncClient(base_url=args.base_url, timeout=60) as console:
        workers = (await console.get("/admin/workers", headers=admin)).json()["workers"]
        if not workers:
            raise SystemExit("no worker is connected to the gateway")
        keys = await tenant_keys(console, admin, args.tenants)
        await sign_in(console, args.admin_token)
        results: Any = multiprocessing.Queue()
        load = multiprocessing.Process(target=_load_process, args=(
            (args.base_url, keys, workers[0]["models"][0], args.streams, args.max_tokens, args.duration_s),
            results))
        load.start()
        timings: dict[str, list[float]] = {name: [] for name in PATHS}
        sizes: list[int] = []
        await asyncio.sleep(args.warmup_s)  # let the queues fill before measuring
        await refresh_loop(console, time.monotonic() + args.duration_s - args.warmup_s, args.interval_s, timings, sizes)
        counts = await asyncio.to_thread(results.get, True, 600)
        await asyncio.to_thread(load.join, 60)
    summary = {
        name: {"n": len(v), "p50_ms": 1000 * percentile(v, 50), "p95_ms": 1000 * percentile(v, 95),
               "max_ms": 1000 * max(v, default=float("nan"))}
        for name, v in timings.items()
    }
    return {"tenants": args.tenants, "streams": args.streams, "duration_s": args.duration_s,
            "interval_s": args.interval_s, "answers": counts, "latency": summary,
            "update_bytes_max": max(sizes, default=0)}


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--admin-token", required=True)
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=90.0)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--interval-s", type=float, default=2.0, help="the page's refresh interval")
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    for name in ("tenants", "streams", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.warmup_s < args.duration_s:
        parser.error("--warmup-s must be positive and shorter than --duration-s")
    result = asyncio.run(main(args))
    for name, row in result["latency"].items():
        print(f"{name:>8}: n={row['n']:4d}  p50 {row['p50_ms']:7.1f} ms  p95 {row['p95_ms']:7.1f} ms  "
              f"max {row['max_ms']:7.1f} ms")
    print(f"stream answers: {result['answers']}; largest update {result['update_bytes_max']} bytes")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
