"""`sluice bench policies`: static vs prefill_first vs chunked on the articles' scenario.

Several streams are decoding when one long prompt arrives. Under prefill_first the whole prompt
is prefilled in one step and every running stream stalls for that step; under chunked the prompt
is cut into chunks that ride along with the decodes, so streams keep flowing at the cost of a
somewhat later first token for the long prompt; under static the long prompt waits until the
whole running batch is done. Identical load for every policy (same seed, same token ids, same
arrival offsets), replayed into one in-process engine per policy with real wall-clock steps.

Headline numbers:
  stall ratio = worst inter-token gap of the streams under prefill_first / under chunked
  TTFT ratio  = the long prompt's TTFT under chunked / under prefill_first
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice_lab.experiments.common import latency_summary, ratio, resolve_model, ttfts_of
from sluice_lab.experiments.replay import ReplayResult, TimedRequest, build_engine, replay, token_gaps, warm_up

POLICIES = ("static", "prefill_first", "chunked")


@dataclass(frozen=True, slots=True)
class PoliciesLoad:
    streams: int = 8
    stream_prompt: int = 32
    stream_output: int = 160
    long_prompt: int = 3072
    long_output: int = 16
    long_after_tokens: int = 16  # the long prompt arrives once every stream has this many tokens
    chunk: int = 256

    @classmethod
    def quick(cls) -> PoliciesLoad:
        return cls(streams=3, stream_prompt=16, stream_output=32, long_prompt=256, long_output=4,
                   long_after_tokens=8, chunk=64)

    def requests(self, vocab: int, seed: int) -> list[TimedRequest]:
        rng = random.Random(seed)

        def prompt(n: int) -> tuple[int, ...]:
            return tuple(rng.randrange(16, vocab) for _ in range(n))  # skip special-token ids

        # The streams arrive together, so static batching runs them as one batch, as the others do.
        reqs = [TimedRequest(f"stream-{i}", 0.0, prompt(self.stream_prompt), self.stream_output)
                for i in range(self.streams)]
        reqs.append(TimedRequest("long", 0.0, prompt(self.long_prompt), self.long_output, role="long",
                                 after=("stream", self.long_after_tokens)))
        return reqs


def engine_overrides(policy: str, load: PoliciesLoad) -> dict[str, Any]:
    # The budget covers the long prompt plus every decode, so only the policy differs:
    # prefill_first/static prefill it whole, chunked caps each request's chunk at `chunk`.
    budget = load.long_prompt + load.streams + 16
    overrides: dict[str, Any] = {"policy": policy, "max_num_batched_tokens": budget,
                                 "max_num_seqs": max(16, load.streams + 1)}
    if policy == "chunked":
        overrides["max_prefill_chunk"] = load.chunk
    return overrides


def summarize_policy(result: ReplayResult) -> dict[str, Any]:
    stream_gaps = token_gaps(result, "stream")
    long = next(r for r in result.records if result.roles[r.request_id] == "long")
    out_tokens = sum(r.completion_tokens for r in result.records)
    return {
        "long_prompt_ttft_s": long.ttft_s,
        "max_stall_s": max(stream_gaps) if stream_gaps else None,
        **latency_summary(ttfts_of(result.records), stream_gaps),
        "output_tokens": out_tokens,
        "throughput_tok_s": out_tokens / result.wall_s if result.wall_s > 0 else None,
        "wall_s": result.wall_s,
        "steps": result.num_steps,
    }


def run_policies(
    model_dir: Path, load: PoliciesLoad, *, seed: int = 0, device: str = "cpu", cpu_threads: int = 1,
    policies: tuple[str, ...] = POLICIES,
) -> tuple[dict[str, Any], dict[str, ReplayResult]]:
    runs: dict[str, ReplayResult] = {}
    for policy in policies:
        engine = build_engine(model_dir, device=device, cpu_threads=cpu_threads,
                              **engine_overrides(policy, load))
        if load.long_prompt >= engine.max_model_len:
            limit = engine.max_model_len - load.long_output - 1
            raise ValueError(f"--long-prompt {load.long_prompt} does not fit the model's max_model_len "
                             f"{engine.max_model_len}; use at most {limit}")
        warm_up(engine, min(load.chunk, load.long_prompt))
        runs[policy] = replay(engine, load.requests(engine.model_config.vocab_size, seed))
        del engine
    per_policy = {policy: summarize_policy(run) for policy, run in runs.items()}
    pf, ch = per_policy.get("prefill_first", {}), per_policy.get("chunked", {})
    stall_ratio = ratio(pf.get("max_stall_s"), ch.get("max_stall_s"))
    ttft_ratio = ratio(ch.get("long_prompt_ttft_s"), pf.get("long_prompt_ttft_s"))
    summary = {
        "stall_ratio_prefill_first_over_chunked": stall_ratio,
        "ttft_ratio_chunked_over_prefill_first": ttft_ratio,
        "target": {"stall_ratio_min": 3.0, "ttft_ratio_max": 1.5},
        "meets_target": bool(stall_ratio is not None and ttft_ratio is not None
                             and stall_ratio >= 3.0 and ttft_ratio <= 1.5),
        "load": {"streams": load.streams, "stream_prompt_tokens": load.stream_prompt,
                 "stream_output_tokens": load.stream_output, "long_prompt_tokens": load.long_prompt,
                 "long_output_tokens": load.long_output,
                 "long_arrives_after_stream_tokens": load.long_after_tokens,
                 "chunk": load.chunk, "seed": seed, "model": str(model_dir), "device": device,
                 "cpu_threads": cpu_threads},
        "policies": per_policy,
    }
    return summary, runs


def plot_policies(summary: dict[str, Any], runs: dict[str, ReplayResult], path: str | Path) -> None:
    from sluice_lab.experiments.plots import new_figure, save

    fig, (timeline, bars) = new_figure(1, 2, figsize=(13, 4.8))
    for policy, run in runs.items():
        start = min(r.arrival for r in run.records)
        xs, ys = [], []
        for rid, times in run.token_times.items():
            if run.roles[rid] == "stream":
                for a, b in itertools.pairwise(times):
                    xs.append(b - start)
                    ys.append(b - a)
        points = timeline.scatter(xs, ys, s=4, label=policy)
        long = next(r for r in run.records if run.roles[r.request_id] == "long")
        timeline.axvline(long.arrival - start, color=points.get_facecolor()[0], linestyle="--", linewidth=1)
    timeline.set(yscale="log", xlabel="time (s)", ylabel="gap between stream tokens (s)",
                 title="Streams' inter-token gaps; dashed = long prompt arrives")
    timeline.legend(fontsize=8)
    names = list(runs)
    stalls = [summary["policies"][p]["max_stall_s"] or 0.0 for p in names]
    ttfts = [summary["policies"][p]["long_prompt_ttft_s"] or 0.0 for p in names]
    x = range(len(names))
    bars.bar([i - 0.2 for i in x], stalls, width=0.4, label="worst stream stall (s)")
    bars.bar([i + 0.2 for i in x], ttfts, width=0.4, label="long prompt TTFT (s)")
    bars.set_xticks(list(x), names)
    stall_ratio = summary["stall_ratio_prefill_first_over_chunked"]
    ttft_ratio = summary["ttft_ratio_chunked_over_prefill_first"]
    title = "policies" if stall_ratio is None or ttft_ratio is None else (
        f"stall ratio pf/chunked = {stall_ratio:.1f}, TTFT ratio chunked/pf = {ttft_ratio:.2f}")
    bars.set(yscale="log", title=title)
    bars.legend(fontsize=8)
    save(fig, path)


def run_policies_command(args: argparse.Namespace) -> int:
    from sluice.errors import CLIError
    from sluice_lab.cli import write_json

    load = PoliciesLoad.quick() if args.quick else PoliciesLoad()
    given = {"chunk": args.chunk, "streams": args.streams, "long_prompt": args.long_prompt}
    changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    for name, value in changes.items():
        if value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be positive, got {value}")
    load = dataclasses.replace(load, **changes)
    if args.cpu_threads < 1:
        raise CLIError("--cpu-threads must be positive")
    summary, runs = run_policies(resolve_model(args.model), load, seed=args.seed, device=args.device,
                                 cpu_threads=args.cpu_threads)
    write_json(args.json_out, summary)
    plot_policies(summary, runs, args.plot)
    for policy, row in summary["policies"].items():
        print(f"{policy:>14}: long-prompt TTFT {row['long_prompt_ttft_s']:.3f} s, worst stream stall "
              f"{row['max_stall_s']:.3f} s, ITL p50/p99 {row['itl_p50_s'] * 1000:.1f}/"
              f"{row['itl_p99_s'] * 1000:.1f} ms, {row['throughput_tok_s']:.1f} tok/s")
    print(f"stall ratio (prefill_first / chunked): {summary['stall_ratio_prefill_first_over_chunked']:.2f} "
          f"(target >= 3); TTFT ratio (chunked / prefill_first): "
          f"{summary['ttft_ratio_chunked_over_prefill_first']:.2f} (target <= 1.5)")
    print(f"wrote {args.json_out} and {args.plot}")
    return 0
