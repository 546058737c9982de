"""`sluice bench chunk-sweep`: the chunked-prefill chunk size as a TTFT/ITL trade-off.

Small chunks keep decodes flowing (low ITL, small stalls) but stretch every long prompt over
many steps (higher TTFT, more per-step overhead); large chunks do the opposite. One seeded mixed
load (mostly chat-length prompts, some RAG-length ones, Poisson arrivals) is replayed into the
engine once per chunk size; the recommendation is the chunk that maximises goodput (requests
meeting both SLOs per second), ties broken by the lower ITL p95.

Goodput uses the same per-request rule as `sluice bench serve`: TTFT <= the TTFT SLO and the
request's own ITL p95 <= the ITL SLO.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.telemetry import RequestRecord
from sluice_lab.experiments.common import latency_summary, resolve_model, ttfts_of
from sluice_lab.experiments.replay import ReplayResult, TimedRequest, build_engine, replay, token_gaps, warm_up
from sluice_lab.loadgen.scenario import Slo


@dataclass(frozen=True, slots=True)
class SweepLoad:
    duration_s: float = 20.0
    rate: float = 2.0  # requests/s, Poisson: loaded enough that chunk sizes differ, short of runaway backlog
    long_fraction: float = 0.3
    short_prompt: tuple[int, int] = (32, 256)
    long_prompt: tuple[int, int] = (1024, 2048)
    output: tuple[int, int] = (32, 96)

    @classmethod
    def quick(cls) -> SweepLoad:
        return cls(duration_s=2.0, rate=3.0, long_fraction=0.3, short_prompt=(8, 32),
                   long_prompt=(128, 256), output=(4, 12))

    def requests(self, vocab: int, seed: int) -> list[TimedRequest]:
        rng = random.Random(seed)
        reqs: list[TimedRequest] = []
        t = rng.expovariate(self.rate)
        while t < self.duration_s:
            is_long = rng.random() < self.long_fraction
            low, high = self.long_prompt if is_long else self.short_prompt
            prompt = tuple(rng.randrange(16, vocab) for _ in range(rng.randint(low, high)))
            reqs.append(TimedRequest(f"req-{len(reqs)}", t, prompt, rng.randint(*self.output),
                                     role="long" if is_long else "short"))
            t += rng.expovariate(self.rate)
        return reqs


def good(record: RequestRecord, slo: Slo) -> bool:
    if record.finish_reason not in ("stop", "length") or record.ttft_s is None:
        return False
    return record.ttft_s <= slo.ttft_s and (record.itl_p95_s is None or record.itl_p95_s <= slo.itl_s)


def point(chunk: int, result: ReplayResult, slo: Slo) -> dict[str, Any]:
    gaps = token_gaps(result)
    out_tokens = sum(r.completion_tokens for r in result.records)
    wall = max(result.wall_s, 1e-9)
    n_good = sum(1 for r in result.records if good(r, slo))
    return {
        "chunk": chunk,
        **latency_summary(ttfts_of(result.records), gaps),
        "max_stall_s": max(gaps) if gaps else None,
        "throughput_tok_s": out_tokens / wall,
        "goodput_rps": n_good / wall,
        "slo_attainment": n_good / len(result.records) if result.records else None,
        "requests": len(result.records),
        "wall_s": result.wall_s,
        "steps": result.num_steps,
    }


def recommend(points: list[dict[str, Any]]) -> int:
    best = max(points, key=lambda p: (p["goodput_rps"], -(p["itl_p95_s"] or float("inf"))))
    return int(best["chunk"])


def run_sweep(model_dir: Path, chunks: list[int], load: SweepLoad, slo: Slo, *, seed: int = 0,
              device: str = "cpu", cpu_threads: int = 1) -> dict[str, Any]:
    points = []
    for chunk in chunks:
        # The chunk is the lever: a step's budget is one chunk plus a decode slot per sequence.
        max_seqs = 32
        engine = build_engine(model_dir, device=device, cpu_threads=cpu_threads, policy="chunked",
                              max_prefill_chunk=chunk, max_num_batched_tokens=chunk + max_seqs,
                              max_num_seqs=max_seqs)
        warm_up(engine, min(chunk, 64))
        result = replay(engine, load.requests(engine.model_config.vocab_size, seed))
        points.append(point(chunk, result, slo))
        del engine
    return {
        "recommended_chunk": recommend(points),
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "load": {"duration_s": load.duration_s, "rate": load.rate, "long_fraction": load.long_fraction,
                 "short_prompt": list(load.short_prompt), "long_prompt": list(load.long_prompt),
                 "output": list(load.output), "seed": seed, "model": str(model_dir), "device": device,
                 "cpu_threads": cpu_threads},
        "points": points,
    }


def plot_sweep(summary: dict[str, Any], path: str | Path) -> None:
    from sluice_lab.experiments.plots import new_figure, save

    fig, (trade, good_ax) = new_figure(1, 2, figsize=(12, 4.8))
    pts = summary["points"]
    xs = [p["itl_p95_s"] or 0.0 for p in pts]
    ys = [p["ttft_p95_s"] or 0.0 for p in pts]
    trade.plot(xs, ys, marker="o")
    for p, x, y in zip(pts, xs, ys, strict=True):
        trade.annotate(str(p["chunk"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    trade.axvline(summary["slo"]["itl_s"], color="grey", linestyle="--", linewidth=1)
    trade.axhline(summary["slo"]["ttft_s"], color="grey", linestyle="--", linewidth=1)
    trade.set(xlabel="ITL p95 (s)", ylabel="TTFT p95 (s)", title="Trade-off per chunk size (dashed = SLO)")
    chunks = [str(p["chunk"]) for p in pts]
    good_ax.bar(chunks, [p["goodput_rps"] for p in pts], color="tab:green", label="goodput (req/s)")
    stall_ax = good_ax.twinx()
    stall_ax.plot(chunks, [p["max_stall_s"] or 0.0 for p in pts], color="tab:red", marker="o",
                  label="max stall (s)")
    good_ax.set(xlabel="chunk size (tokens)", ylabel="goodput (req/s)",
                title=f"recommended chunk: {summary['recommended_chunk']}")
    stall_ax.set_ylabel("max stall (s)")
    save(fig, path)


def run_chunk_sweep_command(args: argparse.Namespace) -> int:
    from sluice.errors import CLIError
    from sluice_lab.cli import write_json

    load = SweepLoad.quick() if args.quick else SweepLoad()
    if args.duration_s is not None:
        if args.duration_s <= 0:
            raise CLIError("--duration-s must be positive")
        load = dataclasses.replace(load, duration_s=args.duration_s)
    if args.rate is not None:
        if args.rate <= 0:
            raise CLIError("--rate must be positive")
        load = dataclasses.replace(load, rate=args.rate)
    slo = Slo.parse(args.slo)
    if args.cpu_threads < 1:
        raise CLIError("--cpu-threads must be positive")
    summary = run_sweep(resolve_model(args.model), args.chunks, load, slo, seed=args.seed, device=args.device,
                        cpu_threads=args.cpu_threads)
    write_json(args.json_out, summary)
    plot_sweep(summary, args.plot)
    for p in summary["points"]:
        print(f"chunk {p['chunk']:>5}: TTFT p95 {p['ttft_p95_s']:.3f} s, "
              f"ITL p95 {p['itl_p95_s'] * 1000:.1f} ms, "
              f"max stall {p['max_stall_s']:.3f} s, {p['throughput_tok_s']:.1f} tok/s, "
              f"goodput {p['goodput_rps']:.2f} req/s")
    print(f"recommended chunk (max goodput under ttft<={slo.ttft_s}s, itl<={slo.itl_s}s): "
          f"{summary['recommended_chunk']}")
    print(f"wrote {args.json_out} and {args.plot}")
    return 0
