"""Where sluice's gateway spends its time in front of an upstream, under closed-loop load.

Starts the fake backend and `sluice serve` with an `[[upstreams]]` entry for it (the same set-up
as `sluice bench gateway-overhead --upstream fake`, same placement), drives `--streams` closed-loop
streams for `--seconds`, and samples the gateway process meanwhile: with the built-in sampler
(`sluice_lab.experiments.stack_sampler`, the default: no tool to install) or with py-spy
(`--py-spy PATH`). Prints the samples by part of the gateway (the event loop idle, aiokafka, the
upstream's HTTP client, the HTTP server, ...), the top frames by own and inclusive time, and
the request records' split of the time to first token (arrival -> dispatch -> first token).
Also prints the CPU per finished request of the gateway process and of its children (the
embedded broker) apart, and the samples by their innermost sluice function (its own time and the
library calls it makes, e.g. `upstream.py:_relay` with the msgspec decode under it): the place to
cut. Writes the raw collapsed stacks to `--out`.

    python bench/profile_upstream_gateway.py --streams 50 --seconds 15
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sluice.telemetry import percentile
from sluice_lab.experiments import overhead_procs as procs
from sluice_lab.experiments.common import resolve_model
from sluice_lab.experiments.stack_sampler import ENV_OUT, ENV_RATE
from sluice_lab.experiments.upstream_overhead import MODEL, request_body
from sluice_lab.loadgen.lean_client import Target, closed_loop, run_loop

# Parts of the gateway, by the first matching frame from the innermost outwards (file names as
# the sampler writes them: "file.py:function"). "idle" = the event loop waiting in its selector.
PARTS = (
    ("idle (event loop waiting)", ("selectors.py:", "epoll")),
    ("aiokafka (producer, consumer, admin)", ("aiokafka", "kafka/", "producer.py", "fetcher.py", "conn.py:",
                                              "sender.py", "message_accumulator.py", "record_batch",
                                              "default_records", "client.py:AIOKafkaClient")),
    ("upstream link (httpx, httpcore, anyio)", ("httpx", "httpcore", "anyio", "_async/", "h11", "upstream.py")),
    ("http server (uvicorn, litestar)", ("uvicorn", "litestar", "httptools", "h11_impl", "protocols")),
    ("tokenization", ("tokenizers", "encode_releasing_gil", "tokenize")),
    ("database (sqlalchemy, aiosqlite)", ("sqlalchemy", "aiosqlite", "asyncpg")),
    ("auth and quotas", ("auth.py", "quotas", "quota")),
    ("dispatch and scheduler", ("dispatch.py", "scheduler", "fair", "slots.py", "kafka_backend.py")),
    ("json / msgspec encoding", ("json", "msgspec", "sse", "encoder")),
)


LOOP = "event loop (idle, or uvloop's own I/O and callbacks)"


def part_of(frames: list[str]) -> str:
    if frames[-1] in ("runners.py:Runner.run", "base_events.py:BaseEventLoop.run_forever"):
        return LOOP  # uvloop runs in C under asyncio.run: its idle wait shows as this frame
    for frame in reversed(frames):
        low = frame.lower()
        for part, needles in PARTS:
            if any(n.lower() in low for n in needles):
                return part
    return "other (event loop, asyncio, sluice glue)"


def read_collapsed(path: Path) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    if not path.is_file():
        return counts
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if stack and count_text.isdigit():
            counts[stack] += int(count_text)
    return counts


def _sluice_frame(frame: str) -> bool:
    """A frame of sluice's own code, as py-spy names it: "func (sluice/gateway/x.py:12)" (the
    built-in sampler's frames carry no directory, so with it every sample has none)."""
    return ("(sluice/" in frame or "/sluice/" in frame) and "site-packages" not in frame


def _short(frame: str) -> str:
    """py-spy's "func (/a/b/file.py:12)" -> "file.py:func"; the sampler's frames are short already."""
    if frame.endswith(")") and " (" in frame:
        func, _, where = frame[:-1].rpartition(" (")
        return f"{where.rsplit('/', 1)[-1].rsplit(':', 1)[0]}:{func}"
    return frame


def by_sluice_function(counts: collections.Counter[str], top: int) -> list[str]:
    """Samples by their innermost sluice frame (its own time and the library code it called);
    samples with no sluice frame by their innermost frame."""
    owners: collections.Counter[str] = collections.Counter()
    total = sum(counts.values())
    for stack, count in counts.items():
        frames = stack.split(";")
        owner = next((f for f in reversed(frames) if _sluice_frame(f)), None)
        owners[_short(owner) if owner is not None else "(no sluice frame) " + _short(frames[-1])] += count
    return [f"  {100 * n / max(total, 1):5.1f}%  {frame}" for frame, n in owners.most_common(top)]


def summarize(counts: collections.Counter[str], top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    parts: collections.Counter[str] = collections.Counter()
    total = sum(counts.values())
    if not total:
        return "no samples"
    for stack, count in counts.items():
        frames = stack.split(";")
        own[frames[-1]] += count
        parts[part_of(frames)] += count
        for frame in set(frames):
            inclusive[frame] += count
    busy = total - parts["idle (event loop waiting)"] - parts[LOOP]
    lines = [f"{total} samples ({busy} in Python code)", "", "by part (% of all samples, % of those in Python code):"]
    lines += [f"  {100 * n / total:5.1f}%  {100 * n / max(busy, 1) if p not in (LOOP, PARTS[0][0]) else 0:5.1f}%  {p}"
              for p, n in parts.most_common()]
    lines += ["", "by innermost sluice function (its own time and the library calls under it):"]
    lines += by_sluice_function(counts, top)
    lines += ["", "own time:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines += ["", "inclusive:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in inclusive.most_common(top)]
    return "\n".join(lines)


def ttft_split(record_log: Path, since: float) -> str:
    """Medians and p99s of arrival -> dispatch and dispatch -> first token from the gateway's records."""
    waits: list[float] = []
    firsts: list[float] = []
    ttfts: list[float] = []
    if record_log.is_file():
        for line in record_log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("arrival", 0) < since or rec.get("dispatch_time") is None or rec.get("ttft_s") is None:
                continue
            waits.append(rec["dispatch_time"] - rec["arrival"])
            firsts.append(rec["first_token_time"] - rec["dispatch_time"])
            ttfts.append(rec["ttft_s"])

    def ms(values: list[float], q: float) -> str:
        value = percentile(values, q)
        return "-" if value is None else f"{value * 1000:.1f}"

    return (f"records: {len(ttfts)}; arrival->dispatch p50 {ms(waits, 50)} p99 {ms(waits, 99)} ms; "
            f"dispatch->first token p50 {ms(firsts, 50)} p99 {ms(firsts, 99)} ms; "
            f"gateway TTFT p50 {ms(ttfts, 50)} p99 {ms(ttfts, 99)} ms")


def _cpu_split(pid: int) -> dict[str, float]:
    """CPU seconds so far of the gateway process alone and of its descendants (the broker)."""
    whole = procs.tree_cpu_s(pid)
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return {"gateway": own, "its children (broker)": whole - own}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--py-spy", default="", help="py-spy's path; default: the built-in sampler")
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--ramp-s", type=float, default=0.0,
                        help="stagger the streams' first requests over this many seconds (0: all at once)")
    parser.add_argument("--rate", type=int, default=200, help="samples per second")
    parser.add_argument("--out", default="gateway-profile.txt", help="collapsed stacks")
    parser.add_argument("--config-dir", default="config")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    placement = procs.Placement.for_cores(sorted(os.sched_getaffinity(0)))
    procs.pin_self(placement.client)
    out = Path(args.out).resolve()
    with tempfile.TemporaryDirectory(prefix="sluice-profile-") as tmp:
        workdir = Path(tmp)
        env: dict[str, str] = {}
        sampled = workdir / "samples.txt"
        if not args.py_spy:
            shim = workdir / "shim"
            shim.mkdir()
            (shim / "sitecustomize.py").write_text(
                "from sluice_lab.experiments.stack_sampler import start_from_env\nstart_from_env()\n")
            env = {ENV_OUT: str(sampled), ENV_RATE: str(args.rate),
                   "PYTHONPATH": os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)}
        backend = procs.start_fake(workdir, placement.backend, ttft_ms=50, itl_ms=20, tokens=32)
        spy: subprocess.Popen[str] | None = None
        try:
            with procs.start_sluice_upstream(args.config_dir, workdir, placement.gateway, backend.url, MODEL,
                                             resolve_model(None), args.streams + 16, env=env) as stack:
                key = stack.create_tenant_key("profile", ceiling="interactive", default_class="interactive",
                                              quotas={"requests_per_minute": 10_000_000})
                target = Target("127.0.0.1", int(stack.base_url.rsplit(":", 1)[1]), "/v1/chat/completions",
                                request_body(32), (("Authorization", f"Bearer {key}"),))
                run_loop(closed_loop(target, 4, requests=16))  # warm-up
                time.sleep(1.2)  # the sampler's next dump covers the warm-up
                before = read_collapsed(sampled)
                started = time.time()
                if args.py_spy:
                    spy = subprocess.Popen([args.py_spy, "record", "--pid", str(stack.process.pid), "--format",
                                            "raw", "--rate", str(args.rate), "--duration", str(int(args.seconds)),
                                            "--output", str(out), "--nonblocking"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                cpu_before = _cpu_split(stack.process.pid)
                results, wall = run_loop(closed_loop(target, args.streams, duration_s=args.seconds, ramp_s=args.ramp_s))
                cpu_after = _cpu_split(stack.process.pid)
                if spy is not None:
                    spy.wait(timeout=60)
                else:
                    time.sleep(1.2)
                    counts = read_collapsed(sampled)
                    counts.subtract(before)
                    counts = +counts
                    out.write_text("".join(f"{s} {n}\n" for s, n in counts.items()))
                time.sleep(0.5)  # the last records are written
                ok = sum(1 for r in results if r.ok)
                print(f"{ok}/{len(results)} ok in {wall:.1f} s ({ok / wall:.1f} req/s) at {args.streams} streams; "
                      f"placement: {placement.describe()}")
                print(ttft_split(stack.record_log, started))
                print("CPU per finished request: " + ", ".join(
                    f"{name} {1000 * (cpu_after[name] - cpu_before[name]) / max(ok, 1):.2f} ms"
                    for name in cpu_after))
        finally:
            backend.stop()
    if spy is not None and spy.returncode != 0:
        print(f"py-spy failed: {spy.stderr.read() if spy.stderr else ''}", file=sys.stderr)
        return 1
    print(summarize(read_collapsed(out), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
