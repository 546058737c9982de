"""`sluice bench engine`: sluice's scheduling policies against HF static batching and vLLM, same requests.

Each workload (sluice_lab/workloads.py; by default `chat`, the headline, then `random`) is one
seeded request set that runs through
  (a) HF `generate` in static batches, left-padded, each batch generating until its longest member
      is done (tokens past a request's own length are waste, not counted), at each of several
      batch sizes: the comparison is against the best of them, so no choice of batch size
      flatters sluice;
  (b) our engine under each policy (and, with `--also-speculation-off`, each policy without
      speculation);
  (c) with `--peer vllm`, vLLM's CPU build in its own interpreter (sluice_lab/peer.py), frozen
      while anything else is timed.
HF and sluice run in this process. Throughput = useful output tokens / wall time, and per CPU
second (the machine may be shared). The headline workload also gets latency points (alone and
16 at once) and each engine its achieved FLOP/s as a fraction of the machine's measured matmul
peak. Also times the scheduler alone (schedule() + update(), CPU time per step).

The JSON has the headline workload's sections at the top level (`workload` names it) and every
other workload's under `scenarios`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from sluice.errors import CLIError
from sluice.protocol import SamplingParams
from sluice.workers.config import SchedulerConfig
from sluice.workers.request import Request
from sluice.workers.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from sluice_lab import peer as bench_peer
from sluice_lab.experiments.cli import positive_int_list
from sluice_lab.loadgen.prompts import LengthDist
from sluice_lab.workloads import WORKLOADS, Workload, chat_prompt_pool, make_workload

# torch is imported inside the functions that run engines: every `sluice` process (a gateway
# replica too) builds the whole parser, and so imports this module for `bench engine`'s arguments;
# a top-level import cost each one seconds of CPU for a library it never uses.
POLICIES = ("chunked", "prefill_first", "static")
DEFAULT_PROMPT_LEN = "lognormal:80:0.6:8:512"
DEFAULT_OUTPUT_LEN = "lognormal:96:0.8:8:1024"


def _length_dist(spec: str) -> LengthDist:
    try:
        return LengthDist.parse(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    # Defaults shaped like chat traffic: modest prompts, answers of widely varying length (the
    # variance static batching pays for in padding and idle rows).
    parser.add_argument("--workloads", default="chat,random",
                        help=f"comma-separated, the first is the headline (of {', '.join(WORKLOADS)}; "
                             "default chat,random)")
    parser.add_argument("--prompt-len", type=_length_dist, default=LengthDist.parse(DEFAULT_PROMPT_LEN),
                        help=f"prompt length distribution of the random workload (default {DEFAULT_PROMPT_LEN})")
    parser.add_argument("--output-len", type=_length_dist, default=LengthDist.parse(DEFAULT_OUTPUT_LEN),
                        help=f"output length distribution (default {DEFAULT_OUTPUT_LEN})")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset")
    parser.add_argument("--hf-batch-sizes", type=positive_int_list, default=[16, 32, 64],
                        help="HF static batch sizes to run; sluice is compared with the fastest")
    parser.add_argument("--skip-hf", action="store_true", help="run sluice only")
    parser.add_argument("--scheduler-sizes", type=positive_int_list, default=[16, 64, 256],
                        help="running-request counts for the scheduler CPU-time measurement")
    # Both sides get the same threads: all cores by default; --threads 1 on a machine shared with
    # other work keeps the numbers from swinging with it.
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads for every engine (default 0 = all cores)")
    bench_peer.add_peer_arguments(parser)
    parser.add_argument("--skip-latency", action="store_true", help="skip the latency points")
    parser.add_argument("--latency-prompt-len", type=int, default=512, help="prompt tokens of a latency point")
    parser.add_argument("--latency-output-len", type=int, default=128, help="output tokens of a latency point")
    parser.add_argument("--latency-streams", type=positive_int_list, default=[1, 16],
                        help="concurrent streams of each latency point")
    parser.add_argument("--no-kernel-build", action="store_true",
                        help="use the native CPU kernels only if they are already built (no C++ compile)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="interleaved rounds of sluice and the peer; each reports its median run")
    parser.add_argument("--also-speculation-off", action="store_true",
                        help="also run each policy with speculation off (reported as '<policy> spec-off')")
    parser.add_argument("--kv-events-ab", action="store_true",
                        help="only the A/B of KV event reporting on/off, interleaved rounds (--repeat, at "
                             "least 3), same engine and requests (src/sluice_lab/kv_events_ab.py)")
    parser.add_argument("--kv-events-output-len", type=int, default=32,
                        help="output tokens of each request of the KV events A/B")


def make_requests(num: int, seed: int, prompt_len: LengthDist, output_len: LengthDist,
                  vocab: int) -> list[tuple[list[int], int]]:
    """The random workload's requests (bench/engine_run.py)."""
    from sluice_lab.workloads import random_requests

    return random_requests(num, seed, prompt_len, output_len, vocab)


def run_hf_static(model_dir: str, workload: Workload, batch_size: int, device: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per batch size clutters the report
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]
    requests = workload.requests
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        _hf_generate(model, [p for p, _ in batch], max(o for _, o in batch), device, workload.temperature,
                     workload.top_p)
    elapsed = time.perf_counter() - start
    useful = sum(o for _, o in requests)
    return {"output_tokens": useful, "seconds": elapsed, "output_tokens_per_s": useful / elapsed,
            "batch_size": batch_size}


def _hf_generate(model: Any, prompts: list[list[int]], new: int, device: str, temperature: float = 0.0,
                 top_p: float = 1.0) -> None:
    """One static batch, left-padded, every row generating `new` tokens (temperature 0: greedy)."""
    import torch
    pad = 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        sampling: dict[str, Any] = ({"do_sample": False} if temperature == 0.0 else
                                    {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0})
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                       eos_token_id=None, pad_token_id=pad, **sampling)


def hf_latency(model_dir: str, prompts: bench_peer.LatencyPoints, device: str) -> dict[str, dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]
    return prompts.time(lambda batch, new: _hf_generate(model, batch, new, device, prompts.temperature,
                                                        prompts.top_p))


def run_sluice(args: argparse.Namespace, variant: str, workload: Workload,
               latency: bench_peer.LatencyPoints | None = None) -> dict[str, Any]:
    """One timed run of sluice's engine: `variant` is a policy, optionally followed by " spec-off"."""
    import dataclasses

    from sluice.workers.cli import engine_config
    from sluice.workers.engine import LLMEngine

    policy, _, modifier = variant.partition(" ")
    config = engine_config(args, args.model, policy)
    if modifier == "spec-off":
        config = dataclasses.replace(config, num_speculative_tokens=0)
    engine = LLMEngine(config)
    prompts = [p for p, _ in workload.requests]
    params = workload.sampling_params()
    engine.generate(prompts[:2], params[:2])  # warm-up outside the timing
    steps_before = engine.scheduler.stats.num_steps
    drafts_before = engine.scheduler.stats.num_draft_tokens
    accepted_before = engine.scheduler.stats.num_accepted_draft_tokens
    start, cpu_start = time.perf_counter(), time.process_time()
    results = engine.generate(prompts, params)
    elapsed, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    produced = sum(len(r.token_ids) for r in results)
    ttfts = sorted(r.first_token_time - r.arrival_time for r in results if r.first_token_time is not None)
    report: dict[str, Any] = {
        "output_tokens": produced, "seconds": elapsed, "output_tokens_per_s": produced / elapsed,
        # CPU seconds the run used: on a shared host the wall time also counts the waits for a core.
        "cpu_seconds": cpu_seconds, "output_tokens_per_cpu_s": produced / cpu_seconds if cpu_seconds else None,
        "steps": engine.scheduler.stats.num_steps - steps_before,
        "speculative_tokens": engine.config.resolved_num_speculative_tokens,
        "draft_tokens": engine.scheduler.stats.num_draft_tokens - drafts_before,
        "accepted_draft_tokens": engine.scheduler.stats.num_accepted_draft_tokens - accepted_before,
        "preemptions": engine.scheduler.stats.num_preemptions, "num_kv_blocks": engine.runner.num_kv_blocks,
        "median_ttft_s": ttfts[len(ttfts) // 2] if ttfts else None}
    if latency is not None:
        def generate(batch: list[list[int]], new: int) -> None:
            engine.generate(batch, [SamplingParams(max_tokens=new, temperature=latency.temperature,
                                                   top_p=latency.top_p, ignore_eos=True,
                                                   seed=None if latency.temperature == 0.0 else args.seed + i)
                                    for i in range(len(batch))])

        report["latency"] = latency.time(generate)
    return report


def steady_decode_scheduler(num_running: int, policy: str, steps: int) -> Scheduler:
    """A scheduler with `num_running` prefilled requests, each with room for `steps` more decodes."""
    block_size, prompt_len = 16, 32
    max_len = prompt_len + steps + 64
    blocks_per_req = -(-max_len // block_size)
    config = SchedulerConfig(policy=policy, block_size=block_size, num_kv_blocks=num_running * blocks_per_req,
                             max_num_batched_tokens=max(2048, num_running * prompt_len),
                             max_num_seqs=num_running, max_model_len=max_len)
    scheduler = Scheduler(config)
    sampling = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(num_running):
        tokens = [(i * 7919 + j) % 1000 + 16 for j in range(prompt_len)]  # distinct: no prefix hits
        scheduler.add_request(Request(f"r{i}", tokens, sampling, arrival_time=float(i)))
    for k in range(4):  # prefill everything, reach steady decode
        schedule_and_update(scheduler, float(k))
    return scheduler


def schedule_and_update(scheduler: Scheduler, now: float) -> SchedulerOutput:
    """One engine step without a model: every sampled position gets token 1."""
    out = scheduler.schedule(now)
    sampled = {c.request.request_id: (1,) * c.num_sample_rows for c in out.chunks if c.sample}
    scheduler.update(out, RunnerOutput(sampled_token_ids=sampled), now)
    return out


def scheduler_step_cpu_ms(num_running: int, policy: str = "chunked", steps: int = 50) -> float:
    """CPU milliseconds of schedule() + update() per step with `num_running` decoding requests."""
    scheduler = steady_decode_scheduler(num_running, policy, steps)
    start = time.process_time()
    for k in range(steps):
        schedule_and_update(scheduler, 100.0 + k)
    return (time.process_time() - start) * 1000 / steps


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from sluice.workers.model.config import ModelConfig

    if args.num_requests < 1:
        raise CLIError("--num-requests must be positive")
    if args.repeat < 1:
        raise CLIError("--repeat must be positive")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        raise CLIError(f"--policies must be a comma-separated subset of {', '.join(POLICIES)}")
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not names or any(w not in WORKLOADS for w in names) or len(set(names)) != len(names):
        raise CLIError(f"--workloads must be a comma-separated subset of {', '.join(WORKLOADS)}, each once")
    if not Path(args.model).is_dir():
        raise CLIError(f"model directory {args.model} does not exist")
    from sluice.workers.cli import engine_config

    config = engine_config(args, args.model)  # unset flags: EngineConfig's defaults
    if args.threads < 0:
        raise CLIError("--threads must be 0 (all cores) or positive")
    bench_peer.check_peer_arguments(args)  # fail before anything runs
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.kv_events_ab:
        from sluice_lab.kv_events_ab import run_kv_events_ab

        ab = run_kv_events_ab(args, engine_config(args, args.model, "chunked"))
        ab["config"] = {"num_requests": args.num_requests, "seed": args.seed, "threads": torch.get_num_threads(),
                        "repeat": max(3, args.repeat), "load_average": os.getloadavg()[0]}
        print(f"KV events on/off: {ab['kv_events_ab']['on_over_off_tokens_per_cpu_s']:.3f} tokens per CPU-s, "
              f"{ab['kv_events_ab']['on_over_off_tokens_per_s']:.3f} tokens per s")
        if args.json is not None:
            args.json.write_text(json.dumps(ab, indent=2) + "\n", encoding="utf-8")
        return 0
    model_cfg = ModelConfig.from_dir(Path(args.model))
    workloads = [make_workload(name, args.model, args.num_requests, args.seed, args.prompt_len, args.output_len,
                               model_cfg.vocab_size) for name in names]
    headline = workloads[0]
    if args.latency_prompt_len < 1 or args.latency_output_len < 2:
        raise CLIError("--latency-prompt-len must be positive and --latency-output-len at least 2")
    latency = None
    if args.skip_latency:
        pass
    elif headline.greedy:
        latency = bench_peer.LatencyPoints.make(model_cfg.vocab_size, args.seed, args.latency_prompt_len,
                                                args.latency_output_len, args.latency_streams)
    else:  # distinct conversations, decoded as the workload decodes
        latency = bench_peer.LatencyPoints.from_pool(chat_prompt_pool(args.model, args.seed), args.latency_output_len,
                                                     args.latency_streams, headline.temperature, headline.top_p)
    variants = [v for p in policies for v in ([p, f"{p} spec-off"] if args.also_speculation_off else [p])]
    report: dict[str, Any] = {
        "workload": headline.name,
        "config": {"num_requests": args.num_requests, "seed": args.seed, "device": config.device,
                   "dtype": config.resolved_dtype, "threads": torch.get_num_threads(),
                   **headline.summary(),
                   "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                   "speculative_tokens": config.resolved_num_speculative_tokens, "repeat": args.repeat,
                   # Shared machines: a high load average marks the numbers as noisy.
                   "load_average_at_start": os.getloadavg()[0]},
    }
    if config.device == "cpu":
        from sluice.kernels import native

        # Built here, outside every timing, so the engines' steps use them from the first one (a
        # C++ compile the first time on a machine; an engine alone only starts those builds in
        # the background and takes the torch path until they are done).
        report["config"].update(native.build_all(compile_missing=not args.no_kernel_build))
        report["matmul_peak"] = bench_peer.matmul_peak(model_cfg)
        print(f"fp32 matmul peak {report['matmul_peak']['gflops']:.1f} GFLOP/s (best of the model's GEMM shapes)")
    peer = None
    peer_info: dict[str, Any] = {}
    if args.peer == "vllm":
        max_len = max(len(p) + o for w in workloads for p, o in w.requests) + 1
        if latency is not None:
            max_len = max(max_len, latency.longest() + 1)
        # A terminated bench (`kill`, a timeout) unwinds as an exit, so the peer is closed below
        # rather than left behind, frozen by SIGSTOP, with its engine's processes.
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
        peer = bench_peer.VllmPeer(args.peer_venv, args.model, {w.name: w.peer_spec() for w in workloads}, latency,
                                   torch.get_num_threads(), max_len, args.peer_speculative_tokens,
                                   config.resolved_dtype)
        try:
            info = peer.call("info")  # waits for its load and warm-up: nothing is timed beside it
        except BaseException:
            peer.close()
            raise
        peer_info = {"version": info["version"], "dtype": info["dtype"], "load_seconds": info["load_seconds"],
                     "speculative_config": info.get("speculative_config")}
        print(f"vllm {info['version']} loaded in {info['load_seconds']:.0f} s")
    sections: dict[str, dict[str, Any]] = {
        w.name: {"sluice": {}, **({"peers": {"vllm": dict(peer_info)}} if peer else {})} for w in workloads}
    try:
        _run_engines(args, sections, variants, workloads, latency, peer, str(config.device))
    finally:
        if peer is not None:
            peer.close()
    for w in workloads:
        print(f"--- workload {w.name} ---")
        _summarise(sections[w.name], bench_peer.useful_flops(model_cfg, w.requests), report.get("matmul_peak"))
    report.update(sections[headline.name])
    report["scenarios"] = {w.name: {"config": w.summary(), **sections[w.name]} for w in workloads[1:]}
    report["scheduler_cpu_ms_per_step"] = {str(n): scheduler_step_cpu_ms(n) for n in args.scheduler_sizes}
    for n, ms in report["scheduler_cpu_ms_per_step"].items():
        print(f"scheduler step with {n:>4} running: {ms:.3f} ms CPU")
    report["config"]["load_average_at_end"] = os.getloadavg()[0]
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput, plus every run's throughput."""
    ordered = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["runs_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs]
    median["runs_output_tokens_per_cpu_s"] = [r.get("output_tokens_per_cpu_s") for r in runs]
    return median


def _run_engines(args: argparse.Namespace, sections: dict[str, dict[str, Any]], variants: list[str],
                 workloads: list[Workload], latency: bench_peer.LatencyPoints | None,
                 peer: bench_peer.VllmPeer | None, device: str) -> None:
    if not args.skip_hf:
        for w in workloads:
            by_batch = {}
            for batch in args.hf_batch_sizes:
                by_batch[str(batch)] = run_hf_static(args.model, w, batch, device)
                print(f"[{w.name}] hf_static batch {batch:<4} {by_batch[str(batch)]['output_tokens_per_s']:10.1f} "
                      "output tok/s")
            sections[w.name]["hf_static_by_batch"] = by_batch
            sections[w.name]["hf_static"] = dict(max(by_batch.values(), key=lambda r: r["output_tokens_per_s"]))
        if latency is not None:
            sections[workloads[0].name]["hf_static"]["latency"] = hf_latency(args.model, latency, device)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(w.name, v): [] for w in workloads for v in variants}
    peer_runs: dict[str, list[dict[str, Any]]] = {w.name: [] for w in workloads}
    # Interleaved rounds: every engine once per round, so a noisy minute hits all of them.
    for round_index in range(args.repeat):
        for w in workloads:
            for variant in variants:
                point = latency if round_index == 0 and w is workloads[0] else None
                result = run_sluice(args, variant, w, point)
                runs[w.name, variant].append(result)
                print(f"[{w.name}] sluice {variant:<18} {result['output_tokens_per_s']:8.1f} output tok/s, "
                      f"{result['output_tokens_per_cpu_s']:6.1f} per CPU s "
                      f"({result['steps']} steps, {result['preemptions']} preemptions, "
                      f"{result['accepted_draft_tokens']}/{result['draft_tokens']} drafts kept, "
                      f"{result['cpu_seconds']:.1f} s CPU in {result['seconds']:.1f} s)")
            if peer is not None:
                peer_runs[w.name].append(peer.call(f"throughput {w.name}"))
                last = peer_runs[w.name][-1]
                cpu = f" ({last['cpu_seconds']:.1f} s CPU in {last['seconds']:.1f} s)" if "cpu_seconds" in last else ""
                print(f"[{w.name}] vllm {'':<20} {last['output_tokens_per_s']:8.1f} output tok/s{cpu}")
    for (name, variant), variant_runs in runs.items():
        sections[name]["sluice"][variant] = _median_run(variant_runs)
        if "latency" in variant_runs[0]:
            sections[name]["sluice"][variant]["latency"] = variant_runs[0]["latency"]
    if peer is not None:
        for w in workloads:
            sections[w.name]["peers"]["vllm"].update(_median_run(peer_runs[w.name]))
        if latency is not None:
            sections[workloads[0].name]["peers"]["vllm"]["latency"] = peer.call("latency")


def _summarise(report: dict[str, Any], flops: float, matmul_peak: dict[str, Any] | None) -> None:
    """Ratios, FLOP/s as a fraction of the matmul peak, and one table of every engine (of one workload)."""
    engines: dict[str, dict[str, Any]] = {}
    if "hf_static" in report:
        engines[f"hf_static (batch {report['hf_static']['batch_size']})"] = report["hf_static"]
    engines.update({f"sluice {p}": r for p, r in report["sluice"].items()})
    engines.update({f"peer {name}": r for name, r in report.get("peers", {}).items()})
    peak = (matmul_peak or {}).get("gflops")
    report["useful_gflop"] = flops / 1e9
    for result in engines.values():
        result["achieved_gflops"] = flops / result["seconds"] / 1e9
        if peak:
            result["fraction_of_matmul_peak"] = result["achieved_gflops"] / peak
    if "hf_static" in report:
        base = report["hf_static"]["output_tokens_per_s"]
        report["speedup_vs_hf"] = {p: r["output_tokens_per_s"] / base for p, r in report["sluice"].items()}
    if "vllm" in report.get("peers", {}):
        base = report["peers"]["vllm"]["output_tokens_per_s"]
        report["speedup_vs_peer"] = {"vllm": {p: r["output_tokens_per_s"] / base for p, r in report["sluice"].items()}}
        # The same ratio per CPU second (each engine's median-throughput run): steadier than wall
        # clock where other processes share the cores.
        peer_cpu = report["peers"]["vllm"].get("output_tokens_per_cpu_s")
        if peer_cpu:
            report["speedup_vs_peer_per_cpu_s"] = {"vllm": {
                p: r["output_tokens_per_cpu_s"] / peer_cpu
                for p, r in report["sluice"].items() if r.get("output_tokens_per_cpu_s")}}
    points = sorted({p for r in engines.values() for p in r.get("latency", {})}, key=lambda p: int(p.split("_")[1]))
    print(f"{'engine':<24} {'tok/s':>8} {'tok/CPUs':>8} {'GFLOP/s':>8} {'%peak':>6} "
          + " ".join(f"{'TTFT/ITL ms @' + p.split('_')[1]:>18}" for p in points))
    for name, r in engines.items():
        lat = r.get("latency", {})
        cells = " ".join(f"{lat[p]['ttft_s'] * 1e3:>9.0f}/{lat[p]['mean_itl_s'] * 1e3:<8.1f}"
                         if p in lat else f"{'-':>18}" for p in points)
        pct = f"{100 * r['fraction_of_matmul_peak']:6.1f}" if "fraction_of_matmul_peak" in r else f"{'-':>6}"
        per_cpu = f"{r['output_tokens_per_cpu_s']:8.1f}" if r.get("output_tokens_per_cpu_s") else f"{'-':>8}"
        print(f"{name:<24} {r['output_tokens_per_s']:8.1f} {per_cpu} {r['achieved_gflops']:8.1f} {pct} {cells}")
    for ref, ratios in [("HF static", report.get("speedup_vs_hf", {})),
                        ("vLLM", report.get("speedup_vs_peer", {}).get("vllm", {})),
                        ("vLLM per CPU second", report.get("speedup_vs_peer_per_cpu_s", {}).get("vllm", {}))]:
        for p, ratio in ratios.items():
            print(f"speedup {p:<13} {ratio:6.2f}x vs {ref}")
