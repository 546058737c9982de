"""`sluice bench slo`: fixed prefill chunk sizes vs the adaptive chunk policy on a phased load (issue #32).

The source articles' question: at which chunk size does the TTFT gain get overtaken by the ITL
cost? The answer depends on the load, so the load comes in phases, each replayed into a fresh
engine per arm (the same prompts at the same offsets; phases outer, arms inner, so a noisy
neighbour on a shared machine hits every arm of a phase alike):

- steady: interactive streams arriving at a steady pace;
- long_while_decoding: long standard-class prompts arrive while interactive streams decode (the
  articles' scenario);
- batch_flood: batch requests only (no targets): throughput;
- burst: a burst of interactive arrivals while a few streams decode.

The prompts (`--workload`): `chat` (the default) takes the shipped conversations, retrieval-style
where a phase wants longer prompts than any conversation, and samples (temperature 0.8, top_p
0.95, a seed per request), as applications send; `random` is the original load, random token ids
decoded greedily, kept to compare with the earlier runs. Either way every request runs to its
phase's output length (ignore_eos), so both workloads have the same shape.

Arms: the `fixed` chunk policy with each chunk size (step budget = chunk + a decode slot per
sequence, as `bench chunk-sweep`), `adaptive` (step budget = the largest chunk + the slots; every
step holds the ITL target) and `adaptive-p95` (the same, with whole-budget steps while each stream
has slow gaps left of the 5 % a p95 objective forgives: `itl_slow_share = 0.05`).
Per phase and arm: goodput (requests meeting their class's targets per second; batch has none,
so a finished batch request counts), interactive ITL p95/p99 over token gaps, interactive TTFT
p95, batch throughput, and the engine cost model's step-time prediction error (median, p95).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sluice.protocol import Priority
from sluice.telemetry import percentile
from sluice_lab.experiments.common import resolve_model
from sluice_lab.experiments.replay import ReplayResult, TimedRequest, build_engine, replay, token_gaps
from sluice_lab.loadgen.scenario import Slo
from sluice_lab.workloads import ChatPrompts, RandomPrompts

PHASES = ("steady", "long_while_decoding", "batch_flood", "burst")
STANDARD_LOOSER = 10.0 / 3.0  # standard's targets / interactive's (the [objectives] defaults: 10 s / 3 s)


@dataclass(frozen=True, slots=True)
class Sizes:
    """Request counts and token lengths of the phases."""

    streams: int = 8
    stream_prompt: tuple[int, int] = (32, 96)
    stream_output: int = 48
    long_prompts: int = 3
    long_prompt: tuple[int, int] = (1024, 1536)
    batch_requests: int = 24
    batch_prompt: tuple[int, int] = (256, 768)
    batch_output: int = 24
    burst: int = 12
    burst_prompt: tuple[int, int] = (128, 384)
    stream_gap_s: float = 0.5  # steady: one stream's arrival after another's
    max_num_seqs: int = 32
    max_model_len: int | None = None  # None: the model's

    @classmethod
    def quick(cls) -> Sizes:
        return cls(streams=3, stream_prompt=(8, 16), stream_output=8, long_prompts=1, long_prompt=(96, 128),
                   batch_requests=4, batch_prompt=(32, 64), batch_output=4, burst=3, burst_prompt=(16, 32))

    @classmethod
    def gpu(cls) -> Sizes:
        """The same phases at a GPU's scale (sized on an H200 with a Llama-3-8B shape: ~60K prefill
        tokens/s in large chunks, a 64-row decode step ~5-9 ms): RAG-length long prompts whose
        prefill in large chunks stalls the streams for tens of steps, a batch flood of ~190K prompt
        tokens, and a burst of ~190K tokens, about 3 s of prefill at the full rate."""
        return cls(streams=16, stream_prompt=(256, 1024), stream_output=128, long_prompts=4,
                   long_prompt=(16384, 32768), batch_requests=96, batch_prompt=(1024, 3072), batch_output=64,
                   burst=48, burst_prompt=(2048, 6144), stream_gap_s=0.1, max_num_seqs=64, max_model_len=33280)


LOADS = {"cpu": Sizes, "gpu": Sizes.gpu, "quick": Sizes.quick}


class PromptSource(Protocol):
    """Where a phase's prompts come from, and how its requests are decoded (sluice_lab.workloads)."""

    name: str
    temperature: float
    top_p: float

    def prompts(self, rng: random.Random, bounds: tuple[int, int], num: int) -> list[list[int]]: ...


def phase_requests(phase: str, sizes: Sizes, slo: Slo, source: PromptSource, seed: int) -> list[TimedRequest]:
    rng = random.Random(f"{seed}-{phase}")
    requests: list[TimedRequest] = []
    sampled = source.temperature > 0

    def add(role: str, bounds: tuple[int, int], num: int, output: int, *, priority: Priority = Priority.INTERACTIVE,
            targets: tuple[float | None, float | None] = (slo.ttft_s, slo.itl_s),
            after: Callable[[int], tuple[str, int] | None] = lambda i: None) -> None:
        for i, prompt in enumerate(source.prompts(rng, bounds, num)):
            requests.append(TimedRequest(
                f"{phase}-{role}-{i}", sizes.stream_gap_s * i if phase == "steady" else 0.0, tuple(prompt), output,
                role=role, priority=priority, after=after(i), ttft_target_s=targets[0], itl_target_s=targets[1],
                temperature=source.temperature, top_p=source.top_p,
                seed=seed * 1_000_003 + len(requests) if sampled else None))

    if phase == "steady":
        add("interactive", sizes.stream_prompt, sizes.streams, sizes.stream_output)
    elif phase == "long_while_decoding":
        add("interactive", sizes.stream_prompt, sizes.streams, 2 * sizes.stream_output)
        add("long", sizes.long_prompt, sizes.long_prompts, 8, priority=Priority.STANDARD,
            targets=_targets("long", slo), after=lambda i: ("interactive", 2 + 4 * i))
    elif phase == "batch_flood":
        add("batch", sizes.batch_prompt, sizes.batch_requests, sizes.batch_output, priority=Priority.BATCH,
            targets=_targets("batch", slo))
    elif phase == "burst":
        add("interactive", sizes.stream_prompt, max(1, sizes.streams // 2), 2 * sizes.stream_output)
        add("burst", sizes.burst_prompt, sizes.burst, sizes.stream_output, after=lambda i: ("interactive", 2))
    else:
        raise ValueError(f"unknown phase {phase!r}")
    return requests


def _targets(role: str, slo: Slo) -> tuple[float | None, float | None]:
    if role == "batch":
        return None, None
    if role == "long":
        return slo.ttft_s * STANDARD_LOOSER, slo.itl_s * STANDARD_LOOSER
    return slo.ttft_s, slo.itl_s


def measure(result: ReplayResult, slo: Slo) -> dict[str, Any]:
    good = 0
    for record in result.records:
        ttft_target, itl_target = _targets(result.roles[record.request_id], slo)
        finished = record.finish_reason in ("stop", "length") and record.ttft_s is not None
        if finished and (ttft_target is None or record.ttft_s <= ttft_target) and (  # type: ignore[operator]
                itl_target is None or record.itl_p95_s is None or record.itl_p95_s <= itl_target):
            good += 1
    latency_sensitive = [r for r in result.records if result.roles[r.request_id] in ("interactive", "burst")]
    gaps = token_gaps(result, "interactive") + token_gaps(result, "burst")
    ttfts = [r.ttft_s for r in latency_sensitive if r.ttft_s is not None]
    batch_tokens = sum(r.prompt_tokens + r.completion_tokens for r in result.records
                       if result.roles[r.request_id] == "batch")
    wall = max(result.wall_s, 1e-9)
    return {
        "requests": len(result.records), "good": good, "wall_s": result.wall_s, "steps": result.num_steps,
        "goodput_rps": good / wall,
        "interactive_itl_p95_s": percentile(gaps, 95), "interactive_itl_p99_s": percentile(gaps, 99),
        "interactive_ttft_p95_s": percentile(ttfts, 95),
        "long_ttft_max_s": max((r.ttft_s or 0.0 for r in result.records if result.roles[r.request_id] == "long"),
                               default=None),
        "batch_tokens_per_s": batch_tokens / wall if batch_tokens else None,
    }


def run_slo_bench(model_dir: Path, chunks: list[int], sizes: Sizes, slo: Slo, *, seed: int = 0,
                  device: str = "cpu", cpu_threads: int = 1, phases: tuple[str, ...] = PHASES,
                  workload: str = "chat", warm_steps: int = 24) -> dict[str, Any]:
    arms = [f"fixed-{c}" for c in chunks] + ["adaptive", "adaptive-p95"]
    largest = max(chunks)
    results: dict[str, dict[str, Any]] = {arm: {} for arm in arms}
    # One engine, the model loaded once; each arm replays a phase on a fresh scheduler (empty queues,
    # prefix cache and cost model) under its own settings.
    model_len = {} if sizes.max_model_len is None else {"max_model_len": sizes.max_model_len}
    engine = build_engine(model_dir, device=device, cpu_threads=cpu_threads, policy="chunked",
                          max_num_seqs=sizes.max_num_seqs, max_num_batched_tokens=largest + sizes.max_num_seqs,
                          **model_len)
    source: PromptSource = (ChatPrompts(model_dir) if workload == "chat"
                            else RandomPrompts(engine.model_config.vocab_size))
    defaults = {"chunk_policy": engine.config.chunk_policy, "max_prefill_chunk": engine.config.max_prefill_chunk,
                "min_prefill_chunk": engine.config.min_prefill_chunk, "itl_slow_share": engine.config.itl_slow_share}
    for phase in phases:
        for arm in arms:
            options = dict(defaults)
            if arm.startswith("adaptive"):
                # adaptive-p95: whole-budget steps within the 5 % of slow gaps a p95 objective forgives.
                options.update(chunk_policy="adaptive", max_num_batched_tokens=largest + sizes.max_num_seqs,
                               min_prefill_chunk=min(chunks), itl_slow_share=0.05 if arm == "adaptive-p95" else 0.0)
            else:
                chunk = int(arm.removeprefix("fixed-"))
                options.update(max_prefill_chunk=chunk, max_num_batched_tokens=chunk + sizes.max_num_seqs)
            engine.reschedule(**options)
            _warm(engine, warm_steps, min(chunks), seed)
            hits_before = engine.scheduler.stats.prefix_hit_tokens
            result = replay(engine, phase_requests(phase, sizes, slo, source, seed))
            point = measure(result, slo)
            point["prefix_hit_tokens"] = engine.scheduler.stats.prefix_hit_tokens - hits_before
            point["cost_model_error"] = engine.scheduler.cost_model.prediction_error()
            point["itl_capped_steps"] = engine.scheduler.stats.num_itl_capped_steps
            results[arm][phase] = point
            print(f"{phase:>20} {arm:>12}: goodput {point['goodput_rps']:.3f} req/s, "
                  f"ITL p95 {_ms(point['interactive_itl_p95_s'])}, TTFT p95 {_s(point['interactive_ttft_p95_s'])}, "
                  f"wall {point['wall_s']:.1f} s", flush=True)
    return {"slo": {"interactive_ttft_s": slo.ttft_s, "interactive_itl_s": slo.itl_s,
                    "standard_factor": STANDARD_LOOSER},
            "load": {"sizes": {k: getattr(sizes, k) for k in Sizes.__dataclass_fields__}, "seed": seed,
                     "workload": {"name": source.name, "temperature": source.temperature, "top_p": source.top_p},
                     "model": str(model_dir), "device": device, "cpu_threads": cpu_threads},
            "arms": results, "verdict": verdict(results, phases)}


def _warm(engine: Any, steps: int, chunk: int, seed: int) -> None:
    """Lazy initialisation out of the measurement, and `steps` varied steps for the cost model
    (streams decoding while prompts of several lengths prefill), so the adaptive arm starts warm."""
    from sluice.protocol import SamplingParams

    rng = random.Random(seed)
    sampling = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"warm-stream-{i}", [rng.randrange(16, 200) for _ in range(16)], sampling)
    lengths = [chunk // 2, chunk, 2 * chunk, 4 * chunk]
    for i, n in enumerate(lengths):
        engine.add_request(f"warm-prompt-{i}", [rng.randrange(16, 200) for _ in range(n)],
                           SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_work:
        engine.step()


def verdict(results: dict[str, dict[str, Any]], phases: tuple[str, ...]) -> dict[str, Any]:
    """The acceptance checks of issue #32, from this run's numbers."""
    fixed = [arm for arm in results if not arm.startswith("adaptive")]

    def total_goodput(arm: str) -> float:
        good = sum(results[arm][p]["good"] for p in phases)
        return good / max(sum(results[arm][p]["wall_s"] for p in phases), 1e-9)

    best_fixed = max(fixed, key=total_goodput)
    per_phase = {}
    for phase in phases:
        best = max(fixed, key=lambda arm: float(results[arm][phase]["goodput_rps"]))
        per_phase[phase] = {"best_fixed": best, "best_fixed_goodput_rps": results[best][phase]["goodput_rps"],
                            "adaptive_goodput_rps": results["adaptive"][phase]["goodput_rps"],
                            "adaptive_over_best": _ratio(results["adaptive"][phase]["goodput_rps"],
                                                         results[best][phase]["goodput_rps"])}
    for phase in phases:
        per_phase[phase]["adaptive_p95_over_best"] = _ratio(results["adaptive-p95"][phase]["goodput_rps"],
                                                            per_phase[phase]["best_fixed_goodput_rps"])
    return {"best_single_fixed": best_fixed, "best_single_fixed_goodput_rps": total_goodput(best_fixed),
            "adaptive_goodput_rps": total_goodput("adaptive"),
            "adaptive_over_best_single_fixed": _ratio(total_goodput("adaptive"), total_goodput(best_fixed)),
            "adaptive_p95_over_best_single_fixed": _ratio(total_goodput("adaptive-p95"), total_goodput(best_fixed)),
            "per_phase": per_phase}


def _ratio(value: float, best: float) -> float | None:
    """value / best; None when no fixed size met any objective (no ratio to state)."""
    return value / best if best > 0 else None


def _x(ratio: float | None) -> str:
    return "- (no fixed size had goodput)" if ratio is None else f"{ratio:.2f}x"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def plot_slo(summary: dict[str, Any], path: str | Path) -> None:
    from sluice_lab.experiments.plots import new_figure, save

    arms = list(summary["arms"])
    phases = [p for p in PHASES if p in summary["arms"][arms[0]]]
    fig, axes = new_figure(1, 3, figsize=(16, 4.8))
    for phase in phases:
        for ax, key, label in ((axes[0], "goodput_rps", "goodput (req/s)"),
                               (axes[1], "interactive_itl_p95_s", "interactive ITL p95 (s)"),
                               (axes[2], "interactive_ttft_p95_s", "interactive TTFT p95 (s)")):
            ax.plot(arms, [summary["arms"][a][phase][key] or 0.0 for a in arms], marker="o", label=phase)
            ax.set(ylabel=label)
    axes[1].axhline(summary["slo"]["interactive_itl_s"], color="grey", linestyle="--", linewidth=1)
    axes[2].axhline(summary["slo"]["interactive_ttft_s"], color="grey", linestyle="--", linewidth=1)
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    axes[0].legend()
    save(fig, path)


def run_slo_command(args: argparse.Namespace) -> int:
    from sluice.errors import CLIError
    from sluice_lab.cli import write_json

    if args.cpu_threads < 1:
        raise CLIError("--cpu-threads must be positive")
    try:
        slo = Slo.parse(args.slo)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    phases = tuple(args.phases) if args.phases else PHASES
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise CLIError(f"--phases: unknown phase(s) {sorted(unknown)}; known: {', '.join(PHASES)}")
    summary = run_slo_bench(resolve_model(args.model), args.chunks, LOADS["quick" if args.quick else args.load](), slo,
                            seed=args.seed, device=args.device, cpu_threads=args.cpu_threads, phases=phases,
                            workload=args.workload)
    write_json(args.json_out, summary)
    plot_slo(summary, args.plot)
    v = summary["verdict"]
    print(f"adaptive / best single fixed ({v['best_single_fixed']}) goodput: "
          f"{_x(v['adaptive_over_best_single_fixed'])}; adaptive-p95: {_x(v['adaptive_p95_over_best_single_fixed'])}")
    for phase, p in v["per_phase"].items():
        print(f"  {phase}: adaptive / best fixed ({p['best_fixed']}): {_x(p['adaptive_over_best'])}, "
              f"adaptive-p95 {_x(p['adaptive_p95_over_best'])}")
    print(f"wrote {args.json_out} and {args.plot}")
    return 0
