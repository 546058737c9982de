"""Where one streamed request's added time to first token goes, checkpoint by checkpoint (issue #17).

Starts the fake backend and one `sluice serve` per `--tree` (a source tree: this one by default;
give two to compare before and after in one run), each with `sluice_lab.experiments.request_trace`
installed, with the placement of `sluice bench gateway-overhead`. Then sends `--requests`
sequential streamed requests (concurrency 1) to each target, interleaved in rounds of `--round`
(direct to the fake, then each gateway), and prints per gateway the median time from the client's
send to each checkpoint and between consecutive ones, and each target's TTFT p50/p99.

    python bench/trace_upstream_request.py --requests 200
    python bench/trace_upstream_request.py --tree /tmp/base --tree . --requests 300
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sluice.telemetry import percentile
from sluice_lab.experiments import overhead_procs as procs
from sluice_lab.experiments import request_trace
from sluice_lab.experiments.common import resolve_model
from sluice_lab.experiments.upstream_overhead import MODEL, level_requests, request_body
from sluice_lab.loadgen.lean_client import StreamResult, Target, closed_loop, run_loop

ORDER = ("received", "auth", "prepare", "tokenized", "admitted", "append_sent", "link_send", "kafka_write",
         "upstream_sent", "upstream_head", "append_acked", "upstream_first", "first_delta", "sse_head", "sse_first",
         "sse_text")


def groups(lines: list[str]) -> list[dict[str, float]]:
    """The trace split into requests: each `received` starts one; a checkpoint's first mark counts."""
    out: list[dict[str, float]] = []
    for line in lines:
        name, _, value = line.partition(" ")
        if name == "received":
            out.append({})
        if out and name not in out[-1]:
            out[-1][name] = float(value)
    return out


def breakdown(results: list[StreamResult], traces: list[dict[str, float]]) -> dict[str, Any]:
    """Median ms from the client's send to each checkpoint, and between consecutive ones."""
    at: dict[str, list[float]] = {name: [] for name in (*ORDER, "client_first_text")}
    steps: dict[str, list[float]] = {}
    for result, trace in zip(results, traces, strict=False):
        if not result.ok or result.first_token is None:
            continue
        marks = {**trace, "client_first_text": result.first_token}
        names = sorted(marks, key=marks.__getitem__)  # as they happened (the ack races the upstream)
        previous = "client_sent"
        previous_t = result.sent
        for name in names:
            at[name].append((marks[name] - result.sent) * 1000)
            steps.setdefault(f"{previous} -> {name}", []).append((marks[name] - previous_t) * 1000)
            previous, previous_t = name, marks[name]
    return {"since_send_ms": {n: round(statistics.median(v), 3) for n, v in at.items() if v},
            "steps_ms": {n: round(statistics.median(v), 3) for n, v in steps.items() if len(v) > len(results) // 2}}


def ttft(results: list[StreamResult]) -> dict[str, float | None]:
    values = [r.ttft_s * 1000 for r in results if r.ok and r.ttft_s is not None]
    p50, p99 = percentile(values, 50), percentile(values, 99)
    return {"requests": len(results), "ok": len(values), "ttft_p50_ms": None if p50 is None else round(p50, 3),
            "ttft_p99_ms": None if p99 is None else round(p99, 3)}


def run_levels(targets: list[tuple[str, Target, Path | None]], levels: list[int], repeats: int,
               saturation_s: float, cpu: dict[str, Callable[[], float]],
               ramp_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Each level (streams; 0 = saturation: 512 streams for `saturation_s`) `repeats` times, the
    targets in turn each time; per target and level the median over the repeats of TTFT p50/p99,
    req/s (saturation: counted over the last 80 % of the window, in-flight dropped) and CPU ms per
    finished request of the target's process tree (`cpu`: for a gateway, with its broker; the
    figure that moves least with the machine's load). With `ramp_s` a level's streams start
    evenly over that many seconds, else all at once; either way they send as many requests per
    stream as `sluice bench gateway-overhead` does."""
    out: dict[str, dict[str, Any]] = {name: {} for name, _, _ in targets}
    for level in levels:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in targets}
        for _ in range(repeats):
            for name, target, _ in targets:
                cpu_before = cpu[name]()
                if level == 0:
                    got, wall = run_loop(closed_loop(target, 512, duration_s=saturation_s))
                    start = min((r.sent for r in got), default=0.0)
                    counted = [r for r in got if r.ok and r.end >= start + 0.2 * saturation_s]
                    rps = len(counted) / (0.8 * saturation_s)
                else:
                    requests = level_requests(level, at_once=ramp_s <= 0)
                    got, wall = run_loop(closed_loop(target, level, requests=requests, ramp_s=ramp_s))
                    rps = sum(1 for r in got if r.ok) / wall
                stats = ttft(got)
                finished = sum(1 for r in got if r.ok)
                runs[name].append({"rps": rps, "p50": stats["ttft_p50_ms"] or float("nan"),
                                   "p99": stats["ttft_p99_ms"] or float("nan"),
                                   "errors": float(len(got) - finished),
                                   "cpu_ms": 1000 * (cpu[name]() - cpu_before) / max(finished, 1)})
        for name, values in runs.items():
            out[name]["sat" if level == 0 else str(level)] = {
                key: round(statistics.median(v[key] for v in values), 2)
                for key in ("rps", "p50", "p99", "errors", "cpu_ms")}
            out[name]["sat" if level == 0 else str(level)]["runs"] = values
    return out


def shim_for(workdir: Path, tree: Path, profile: str = "") -> dict[str, str]:
    """The gateway's environment: `tree` first on its path, and a sitecustomize that installs the tracer
    (copied in, so a tree that predates the tracer is traced the same way)."""
    shim = workdir / "shim"
    shim.mkdir(parents=True)
    shutil.copy(request_trace.__file__, shim / "sluice_request_trace.py")
    # A tree that lacks a traced method (it was rewritten) runs without that checkpoint and those
    # after it in `install`'s order (the upstream's first event is the last), not with a failed start.
    (shim / "sitecustomize.py").write_text(
        "import sys\nimport sluice_request_trace\ntry:\n    sluice_request_trace.start_from_env()\n"
        "except AttributeError as exc:\n    print(f'request trace: not traced here: {exc}', file=sys.stderr)\n")
    trace = workdir / "trace.txt"
    env = {request_trace.ENV_OUT: str(trace), "PYTHONPATH": f"{shim}{os.pathsep}{tree.resolve()}"}
    if profile:
        env[request_trace.ENV_PROFILE] = str(Path(profile).resolve())
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[],
                        help="source tree of a gateway, optionally with environment settings for it: "
                             "PATH[,SLUICE_X=V...] (repeatable)")
    parser.add_argument("--requests", type=int, default=200, help="per target")
    parser.add_argument("--round", type=int, default=10, help="requests per target per round")
    parser.add_argument("--levels", default="", help="then these stream counts, 0 = saturation (e.g. 50,200,0)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each level, targets interleaved")
    parser.add_argument("--saturation-s", type=float, default=12.0)
    parser.add_argument("--ramp-s", type=float, default=0.0,
                        help="start each level's streams over this many seconds (0: all at once)")
    parser.add_argument("--config-dir", default="config")
    parser.add_argument("--json", default="", help="write the figures here")
    parser.add_argument("--profile", default="", help="cProfile the (first) gateway into this file (distorts timings)")
    args = parser.parse_args()
    trees: list[tuple[Path, dict[str, str]]] = []
    for spec in args.tree or ["."]:
        path, *settings = spec.split(",")
        trees.append((Path(path), dict(item.split("=", 1) for item in settings)))
    placement = procs.Placement.for_cores(sorted(os.sched_getaffinity(0)))
    procs.pin_self(placement.client)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="sluice-trace-") as tmp:
        workdir = Path(tmp)
        backend = procs.start_fake(workdir, placement.backend, ttft_ms=50, itl_ms=20, tokens=32)
        stacks: list[Any] = []
        try:
            targets: list[tuple[str, Target, Path | None]] = [
                ("direct", Target("127.0.0.1", backend.port, "/v1/chat/completions", request_body(32)), None)]
            cpu: dict[str, Callable[[], float]] = {"direct": backend.cpu_s}
            for i, (tree, extra) in enumerate(trees):
                env = {**shim_for(workdir / f"g{i}", tree, args.profile if i == 0 else ""), **extra}
                stack = procs.start_sluice_upstream(args.config_dir, workdir / f"g{i}", placement.gateway,
                                                    backend.url, MODEL, resolve_model(None), 528, env=env)
                stacks.append(stack)
                key = stack.create_tenant_key(f"trace{i}", ceiling="interactive", default_class="interactive",
                                              quotas={"requests_per_minute": 10_000_000})
                port = int(stack.base_url.rsplit(":", 1)[1])
                label = ",".join([str(tree), *(f"{k}={v}" for k, v in extra.items())])
                targets.append((f"sluice[{label}]", Target("127.0.0.1", port, "/v1/chat/completions",
                                                          request_body(32), (("Authorization", f"Bearer {key}"),)),
                                Path(env[request_trace.ENV_OUT])))
                cpu[targets[-1][0]] = functools.partial(procs.tree_cpu_s, stack.process.pid)
            results: dict[str, list[StreamResult]] = {name: [] for name, _, _ in targets}
            traces: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in targets}
            for _, target, _ in targets:
                run_loop(closed_loop(target, 1, requests=5))  # warm-up: connections, caches
            done = 0
            while done < args.requests:
                batch = min(args.round, args.requests - done)
                for name, target, trace in targets:
                    offset = trace.stat().st_size if trace is not None and trace.exists() else 0
                    got, _ = run_loop(closed_loop(target, 1, requests=batch))
                    results[name] += got
                    if trace is not None:
                        time.sleep(0.05)  # the last request's marks are written
                        with trace.open() as f:
                            f.seek(offset)
                            traces[name] += groups(f.read().splitlines())[:batch]
                done += batch
            levels = run_levels(targets, [int(v) for v in args.levels.split(",") if v], args.repeats,
                                args.saturation_s, cpu, args.ramp_s)
        finally:
            for stack in stacks:
                stack.stop()
            backend.stop()
    report: dict[str, Any] = {"loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                              "placement": placement.describe(), "targets": {}}
    direct = ttft(results["direct"])
    for name, _, trace in targets:
        entry: dict[str, Any] = ttft(results[name])
        if trace is not None:
            if direct["ttft_p50_ms"] is not None and entry["ttft_p50_ms"] is not None:
                entry["delta_ttft_p50_ms"] = round(entry["ttft_p50_ms"] - direct["ttft_p50_ms"], 3)
            entry.update(breakdown(results[name], traces[name]))
        entry["levels"] = levels.get(name, {})
        report["targets"][name] = entry
    print(f"load average before {load_before}, after {report['loadavg_after']}; {placement.describe()}")
    for name, entry in report["targets"].items():
        delta = f", ΔTTFT p50 {entry['delta_ttft_p50_ms']:+.2f} ms" if "delta_ttft_p50_ms" in entry else ""
        print(f"\n{name}: {entry['ok']}/{entry['requests']} ok, TTFT p50 {entry['ttft_p50_ms']} p99 "
              f"{entry['ttft_p99_ms']} ms{delta}")
        for step, ms in entry.get("steps_ms", {}).items():
            print(f"  {ms:8.3f} ms  {step}")
        for level, figures in entry["levels"].items():
            print(f"  {level:>4} streams: TTFT p50 {figures['p50']} p99 {figures['p99']} ms, {figures['rps']} req/s, "
                  f"{figures['cpu_ms']} ms CPU/req, {figures['errors']:g} errors (medians of {len(figures['runs'])})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
