"""`sluice bench gateway-overhead --upstream fake --vs litellm`: sluice and LiteLLM, side by side.

One run, one fake OpenAI backend (src/sluice_lab/fake_openai.py: fixed TTFT, per-token delay, token count)
and one load client (sluice_lab.loadgen.lean_client), three targets in turn:
  direct   the load client straight to the fake backend (the baseline)
  sluice   `sluice serve` with no local workers and an `[[upstreams]]` entry for the fake: auth,
           quotas (a tenant with limits, checked on every request), tokenization, the acks=all
           Kafka enqueue, the fair scheduler and the upstream link all on the path
  litellm  LiteLLM proxy (its own virtualenv, `make bench-peers-litellm`), default settings: one
           process, one model entry pointing at the fake
Each target gets closed-loop runs at each concurrency level (every stream sends its next request
when the last one ends), then a saturation run: many streams for a fixed time, req/s counted
over its last 80 %. Deltas are a target's percentile minus direct's at the same level; ITL added
is the mean gap between text chunks minus direct's. CPU per request is the CPU time of the
target's own processes (and separately the backend's and this client's) over the requests run.
Each gateway runs only for its own turn, so an idle one does not take CPU from another.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.errors import CLIError
from sluice.telemetry import percentile
from sluice_lab.experiments import overhead_procs as procs
from sluice_lab.loadgen.lean_client import StreamResult, Target, closed_loop, run_loop

MODEL = "fake-model"
PROMPT = "Describe the gateway overhead of this request in a few words please thank you"
TARGETS = ("direct", "sluice", "litellm")
GOALS = {"sluice_delta_ttft_p50_s_at_1_max": 0.003, "sluice_delta_ttft_p99_s_at_200_max": 0.015,
         "sluice_over_litellm_saturated_rps_min": 10.0}


# Requests per stream at a level: streams ramped over one request's length (the first ones arrive
# while the others start), or all started at once (a burst; the load of the runs before ramping).
REQUESTS_PER_STREAM = 5
REQUESTS_PER_STREAM_AT_ONCE = 3


def level_requests(concurrency: int, *, at_once: bool) -> int:
    """The requests a level of `concurrency` streams sends by default (at least 20)."""
    return max((REQUESTS_PER_STREAM_AT_ONCE if at_once else REQUESTS_PER_STREAM) * concurrency, 20)


@dataclass(frozen=True, slots=True)
class BenchPlan:
    levels: tuple[int, ...]
    per_level: int | None  # None: level_requests
    saturation_streams: int
    saturation_s: float
    ttft_ms: float
    itl_ms: float
    tokens: int
    nice: int = 0
    ramp_s: float | None = None  # None: one request's length at the fake's timing

    def requests_at(self, concurrency: int) -> int:
        return self.per_level or level_requests(concurrency, at_once=False)

    def burst_requests_at(self, concurrency: int) -> int:
        return self.per_level or level_requests(concurrency, at_once=True)

    @property
    def stagger_s(self) -> float:
        """Over how long each level's streams start (`closed_loop`'s `ramp_s`). By default one
        request's length: arrivals are then spread as in a steady state of that many concurrent
        streams. With 0 they all start in the same instant (measured besides as `burst`)."""
        if self.ramp_s is not None:
            return self.ramp_s
        return (self.ttft_ms + (self.tokens - 1) * self.itl_ms) / 1000


def request_body(tokens: int) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                       "max_tokens": tokens, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def level_stats(results: list[StreamResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps()]
    kinds = collections.Counter(r.error for r in results if r.error)
    examples = {r.error: r.error_detail for r in reversed(results) if r.error}
    return {"requests": len(results), "errors": len(results) - len(ok), "error_kinds": dict(kinds),
            "error_examples": examples, "wall_s": wall_s,
            "rps": len(ok) / wall_s if wall_s > 0 else None,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_mean_s": _mean(gaps), "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "tokens_per_request": _mean([float(len(r.token_times)) for r in ok])}


class _CpuMeter:
    """CPU seconds of the target, the backend and this client between start() and stop()."""

    def __init__(self, target: procs.Proc | procs.Stack | None, backend: procs.Proc) -> None:
        self.target, self.backend = target, backend

    def _read(self) -> tuple[float, float, float]:
        target = 0.0
        if isinstance(self.target, procs.Proc):
            target = self.target.cpu_s()
        elif self.target is not None:
            target = procs.tree_cpu_s(self.target.process.pid)
        own = os.times()
        return target, self.backend.cpu_s(), own.user + own.system

    def start(self) -> None:
        self.before = self._read()

    def per_request(self, requests: int) -> dict[str, float | None]:
        after = self._read()
        used = [a - b for a, b in zip(after, self.before, strict=True)]
        n = max(requests, 1)
        return {"cpu_per_request_s": used[0] / n if self.target is not None else used[1] / n,
                "backend_cpu_per_request_s": used[1] / n, "client_cpu_per_request_s": used[2] / n}


def measure_target(url: str, headers: tuple[tuple[str, str], ...], plan: BenchPlan,
                   meter: _CpuMeter, progress: bool = True) -> dict[str, Any]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    target = Target(parts.hostname or "127.0.0.1", parts.port or 80, "/v1/chat/completions",
                    request_body(plan.tokens), headers)
    # Warm-up: lazy imports, tokenizer loading, Kafka metadata, connection pools.
    warm, _ = run_loop(closed_loop(target, 4, requests=16))
    if not any(r.ok for r in warm):
        raise CLIError(f"{url}: every warm-up request failed ({warm[0].error})")

    def run_level(concurrency: int, requests: int, ramp_s: float, label: str) -> dict[str, Any]:
        meter.start()
        results, wall = run_loop(closed_loop(target, concurrency, requests=requests, ramp_s=ramp_s))
        row = {**level_stats(results, wall), **meter.per_request(len(results))}
        if progress:
            print(f"  c={label}: ttft p50 {_ms(row['ttft_p50_s'])} p99 {_ms(row['ttft_p99_s'])}, "
                  f"{row['errors']} errors", flush=True)
        return row

    out: dict[str, Any] = {"levels": {}}
    for concurrency in plan.levels:
        ramp = plan.stagger_s if concurrency > 1 else 0.0
        row = out["levels"][str(concurrency)] = run_level(concurrency, plan.requests_at(concurrency), ramp,
                                                          str(concurrency))
        if concurrency > 1 and plan.stagger_s > 0:
            # The same level with every stream starting in the same instant: a burst to absorb.
            row["burst"] = run_level(concurrency, plan.burst_requests_at(concurrency), 0.0,
                                     f"{concurrency}, all at once")
    meter.start()
    results, wall = run_loop(closed_loop(target, plan.saturation_streams, duration_s=plan.saturation_s,
                                         ramp_s=plan.stagger_s))
    window_start = min((r.sent for r in results), default=0.0) + 0.2 * wall
    counted = [r for r in results if r.ok and r.end >= window_start]
    span = max(r.end for r in results) - window_start if counted else 0.0
    saturation = {**level_stats(results, wall), **meter.per_request(len(results)),
                  "streams": plan.saturation_streams, "duration_s": plan.saturation_s}
    out["saturated_rps"] = len(counted) / span if span > 0 else None
    out["saturation"] = saturation
    out["cpu_per_request_s"] = saturation["cpu_per_request_s"]
    if progress:
        print(f"  saturation ({plan.saturation_streams} streams): {out['saturated_rps'] or 0:.0f} req/s, "
              f"{saturation['errors']} errors", flush=True)
    return out


def add_deltas(summary: dict[str, Any]) -> None:
    direct = summary["direct"]
    for name in TARGETS[1:]:
        column = summary.get(name)
        if column is None:
            continue
        for level, row in column["levels"].items():
            base = direct["levels"][level]
            _deltas(row, base)
            if "burst" in row and "burst" in base:
                _deltas(row["burst"], base["burst"])
    for row in direct["levels"].values():
        for each in (row, row.get("burst")):
            if each is not None:
                each.update(delta_ttft_p50_s=0.0, delta_ttft_p99_s=0.0, itl_added_s=0.0, delta_itl_p99_s=0.0)


def _deltas(row: dict[str, Any], base: dict[str, Any]) -> None:
    for key, base_key in (("delta_ttft_p50_s", "ttft_p50_s"), ("delta_ttft_p99_s", "ttft_p99_s"),
                          ("itl_added_s", "itl_mean_s"), ("delta_itl_p99_s", "itl_p99_s")):
        row[key] = _minus(row[base_key], base[base_key])


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    sluice, litellm = summary.get("sluice"), summary.get("litellm")
    out: dict[str, Any] = {}
    if sluice is None:
        return out
    at1, at200 = sluice["levels"].get("1"), sluice["levels"].get("200")
    if at1 and at1["delta_ttft_p50_s"] is not None:
        out["delta_ttft_p50_at_1_met"] = at1["delta_ttft_p50_s"] <= GOALS["sluice_delta_ttft_p50_s_at_1_max"]
    if at200 and at200["delta_ttft_p99_s"] is not None:
        out["delta_ttft_p99_at_200_met"] = at200["delta_ttft_p99_s"] <= GOALS["sluice_delta_ttft_p99_s_at_200_max"]
        if at200.get("burst", {}).get("delta_ttft_p99_s") is not None:
            out["burst_delta_ttft_p99_at_200_s"] = at200["burst"]["delta_ttft_p99_s"]  # reported, no goal
    if litellm and sluice["saturated_rps"] and litellm["saturated_rps"]:
        out["rps_ratio_sluice_over_litellm"] = sluice["saturated_rps"] / litellm["saturated_rps"]
        out["rps_ratio_met"] = out["rps_ratio_sluice_over_litellm"] >= GOALS["sluice_over_litellm_saturated_rps_min"]
    elif litellm and sluice["saturated_rps"]:
        # A peer slower than the window (its TTFT beyond saturation_s) finishes nothing in it.
        out["rps_ratio_met"] = True
        out["rps_ratio_note"] = "litellm finished no request within the saturation window"
    if litellm:
        # Closed-loop throughput at each level: a ratio even when the saturation run has none.
        out["closed_loop_rps_ratio_by_level"] = {
            level: row["rps"] / litellm["levels"][level]["rps"]
            for level, row in sluice["levels"].items()
            if row.get("rps") and litellm["levels"].get(level, {}).get("rps")}
    return out


def run_side_by_side(plan: BenchPlan, vs: tuple[str, ...], config_dir: str, model_dir: Path,
                     workdir: Path, progress: bool = True) -> dict[str, Any]:
    placement = procs.Placement.for_cores(sorted(os.sched_getaffinity(0)))
    procs.pin_self(placement.client, plan.nice)
    summary: dict[str, Any] = {
        "backend": {"kind": "fake (src/sluice_lab/fake_openai.py)", "ttft_s": plan.ttft_ms / 1000,
                    "itl_s": plan.itl_ms / 1000, "tokens": plan.tokens},
        "placement": {"client_cpus": list(placement.client), "backend_cpus": list(placement.backend),
                      "gateway_cpus": list(placement.gateway), "machine_cpus": os.cpu_count(),
                      "load_average_at_start": list(os.getloadavg()), "note": placement.describe(),
                      "nice": plan.nice},
        "plan": {"levels": list(plan.levels), "requests_per_level": {str(c): plan.requests_at(c) for c in plan.levels},
                 "requests_per_level_all_at_once": {str(c): plan.burst_requests_at(c) for c in plan.levels if c > 1},
                 "saturation_streams": plan.saturation_streams, "saturation_s": plan.saturation_s,
                 "ramp_s": plan.stagger_s,
                 "arrivals": "each level's streams start evenly over ramp_s (one request's length by default), "
                             f"then each sends its next request when its last one ends ({REQUESTS_PER_STREAM} "
                             "requests per stream: the first ones arrive while the others start). Levels above 1 "
                             "are also run with every stream starting in the same instant ('burst', "
                             f"{REQUESTS_PER_STREAM_AT_ONCE} requests per stream)",
                 "endpoint": "/v1/chat/completions (streamed)", "client": "sluice_lab.loadgen.lean_client"},
        "goals": GOALS, "skipped": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    backend = procs.start_fake(workdir, placement.backend, ttft_ms=plan.ttft_ms, itl_ms=plan.itl_ms,
                               tokens=plan.tokens, nice=plan.nice)
    try:
        if progress:
            print(f"placement: {placement.describe()}\ndirect:", flush=True)
        summary["direct"] = measure_target(backend.url, (), plan, _CpuMeter(None, backend), progress)
        if "sluice" in vs:
            if progress:
                print("sluice:", flush=True)
            max_concurrency = max(*plan.levels, plan.saturation_streams) + 16
            with procs.start_sluice_upstream(config_dir, workdir, placement.gateway, backend.url, MODEL,
                                             model_dir, max_concurrency, plan.nice) as stack:
                key = stack.create_tenant_key(
                    "bench-upstream", ceiling="interactive", default_class="interactive",
                    quotas={"requests_per_minute": 10_000_000, "tokens_per_minute": 1_000_000_000,
                            "max_concurrent": 100_000})
                summary["sluice"] = measure_target(stack.base_url, (("Authorization", f"Bearer {key}"),),
                                                   plan, _CpuMeter(stack, backend), progress)
        if "litellm" in vs:
            reason = procs.litellm_available()
            if reason:
                summary["skipped"]["litellm"] = reason
            else:
                if progress:
                    print("litellm:", flush=True)
                summary["litellm_version"] = procs.litellm_version()
                master_key = f"sk-bench-{secrets.token_hex(16)}"
                proxy = procs.start_litellm(workdir, placement.gateway, backend.url, MODEL, master_key,
                                            plan.nice)
                try:
                    summary["litellm"] = measure_target(proxy.url, (("Authorization", f"Bearer {master_key}"),),
                                                        plan, _CpuMeter(proxy, backend), progress)
                finally:
                    proxy.stop()
    finally:
        backend.stop()
    add_deltas(summary)
    summary["verdict"] = verdict(summary)
    return summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_table(summary: dict[str, Any]) -> str:
    names = [n for n in TARGETS if summary.get(n)]
    lines = [f"{'target':<8} {'streams':>7} {'TTFT p50':>9} {'p99':>8} {'ΔTTFT p50':>10} {'Δp99':>8} "
             f"{'ITL+':>7} {'req/s':>7} {'CPU/req':>8} {'err':>4}   (ms)"]
    for name in names:
        column = summary[name]
        for level, row in column["levels"].items():
            for label, each in ((level, row), (f"{level} b", row.get("burst"))):
                if each is None:
                    continue
                lines.append(f"{name:<8} {label:>7} {_ms(each['ttft_p50_s']):>9} {_ms(each['ttft_p99_s']):>8} "
                             f"{_ms(each['delta_ttft_p50_s']):>10} {_ms(each['delta_ttft_p99_s']):>8} "
                             f"{_ms(each['itl_added_s']):>7} {each['rps'] or 0:>7.1f} "
                             f"{_ms(each['cpu_per_request_s']):>8} {each['errors']:>4}")
        sat = column["saturation"]
        lines.append(f"{name:<8} {'sat ' + str(sat['streams']):>7} {_ms(sat['ttft_p50_s']):>9} "
                     f"{_ms(sat['ttft_p99_s']):>8} {'':>10} {'':>8} {'':>7} {column['saturated_rps'] or 0:>7.1f} "
                     f"{_ms(column['cpu_per_request_s']):>8} {sat['errors']:>4}")
    for name, reason in summary["skipped"].items():
        lines.append(f"{name}: skipped ({reason})")
    lines.append(f"streams start over {summary['plan']['ramp_s'] * 1000:.0f} ms; 'N b': all N at once")
    lines.append(f"placement: {summary['placement']['note']}")
    return "\n".join(lines)


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    if args.quick:
        return BenchPlan(levels=tuple(args.concurrency or (1, 4)), per_level=args.requests_per_level or 6,
                         saturation_streams=args.saturation_streams or 8, saturation_s=args.saturation_s or 1.5,
                         ttft_ms=args.fake_ttft_ms, itl_ms=args.fake_itl_ms, tokens=min(args.fake_tokens, 8),
                         nice=args.nice, ramp_s=args.ramp_s)
    return BenchPlan(levels=tuple(args.concurrency or (1, 50, 200)), per_level=args.requests_per_level,
                     saturation_streams=args.saturation_streams or 512, saturation_s=args.saturation_s or 12.0,
                     ttft_ms=args.fake_ttft_ms, itl_ms=args.fake_itl_ms, tokens=args.fake_tokens,
                     nice=args.nice, ramp_s=args.ramp_s)


def run_upstream_overhead_command(args: argparse.Namespace) -> int:
    from sluice_lab.cli import write_json
    from sluice_lab.experiments.common import resolve_model

    if args.upstream != "fake":
        raise CLIError(f"--upstream: only 'fake' is supported, got {args.upstream!r}")
    vs = tuple(v for v in (args.vs or "").split(",") if v)
    unknown = sorted(set(vs) - {"litellm", "sluice"})
    if unknown:
        raise CLIError(f"--vs: unknown peer(s) {unknown}; known: litellm")
    if args.requests_per_level is not None and args.requests_per_level < 1:
        raise CLIError("--requests-per-level must be positive")
    plan = plan_from_args(args)
    if plan.ramp_s is not None and not 0 <= plan.ramp_s <= 60:
        raise CLIError(f"--ramp-s must be between 0 and 60 seconds, got {plan.ramp_s:g}")
    if plan.saturation_streams < 1 or plan.saturation_s <= 0:
        raise CLIError("--saturation-streams and --saturation-s must be positive")
    targets = ("sluice", *vs) if not args.no_sluice else vs
    # A SIGTERM (timeout, Ctrl-C from a supervisor) unwinds through the finally blocks that stop
    # the backend and the gateways instead of leaving them running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="sluice-upstream-overhead-") as tmp:
        summary = run_side_by_side(plan, targets, args.config_dir, resolve_model(args.model), Path(tmp))
    write_json(args.json_out, summary)
    print(format_table(summary))
    print(f"wrote {args.json_out}")
    return 0
