"""`sluice bench engine`: sluice's scheduling policies against HF static batching, same requests.

One seeded request set (prompt and output lengths drawn from configurable distributions, random
token ids, ignore_eos so every output has its drawn length) runs through
  (a) HF `generate` in static batches, left-padded, greedy, each batch generating until its
      longest member is done (tokens past a request's own length are waste, not counted);
  (b) our engine under each policy.
All in one process, one run each; throughput = useful output tokens / wall time. Also times the
scheduler alone (schedule() + update(), CPU time per step) with synthetic decode batches.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.errors import CLIError
from sluice.protocol import SamplingParams

POLICIES = ("chunked", "prefill_first", "static")


@dataclass(frozen=True, slots=True)
class LengthDist:
    """"fixed:N", "uniform:LO:HI" (inclusive) or "normal:MEAN:STD" (rounded, clamped to >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = text.split(":")
        try:
            nums = [float(p) for p in parts[1:]]
        except ValueError:
            nums = []
        ok = (parts[0] == "fixed" and len(nums) == 1 and nums[0] >= 1) or (
            parts[0] in ("uniform", "normal") and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0
            and (parts[0] == "normal" or nums[1] >= nums[0]))
        if not ok:
            raise CLIError(f"bad length distribution {text!r}; use fixed:N, uniform:LO:HI or normal:MEAN:STD")
        return cls(parts[0], nums[0], nums[1] if len(nums) > 1 else 0.0)

    def sample(self, n: int, gen: torch.Generator) -> list[int]:
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return torch.randint(int(self.a), int(self.b) + 1, (n,), generator=gen).tolist()
        values = torch.normal(self.a, self.b, (n,), generator=gen).round().clamp(min=1)
        return [int(v) for v in values.tolist()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    # Defaults shaped like chat traffic: modest prompts, answers of widely varying length (the
    # variance static batching pays for in padding and idle rows).
    parser.add_argument("--prompt-len", type=LengthDist.parse, default=LengthDist.parse("uniform:8:128"))
    parser.add_argument("--output-len", type=LengthDist.parse, default=LengthDist.parse("uniform:16:256"))
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="run sluice only")
    parser.add_argument("--scheduler-sizes", default="16,64,256",
                        help="running-request counts for the scheduler CPU-time measurement")
    # One thread by default: on a shared host, intra-op threads waiting for each other dominate the
    # small ops of a small model and make both sides' numbers swing tenfold between runs.
    # Both sides get the same threads. All cores is the honest default for "this machine"; on a
    # machine shared with other work, --threads 1 keeps one process from starving the other.
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads for both HF and sluice (default 0 = all cores)")


def make_requests(num: int, seed: int, prompt_len: LengthDist, output_len: LengthDist,
                  vocab: int) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = prompt_len.sample(num, gen)
    output_lens = output_len.sample(num, gen)
    # Skip the lowest ids, where tokenizers keep their special tokens.
    low = min(16, vocab - 1)
    return [(torch.randint(low, vocab, (p,), generator=gen).tolist(), o)
            for p, o in zip(prompt_lens, output_lens, strict=True)]


def run_hf_static(model_dir: str, requests: list[tuple[list[int], int]], batch_size: int,
                  device: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]
    pad = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.int64)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(batch):  # left padding
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            new = max(o for _, o in batch)
            model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                           max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    useful = sum(o for _, o in requests)
    return {"output_tokens": useful, "seconds": elapsed, "output_tokens_per_s": useful / elapsed,
            "batch_size": batch_size}


def run_sluice(args: argparse.Namespace, policy: str,
               requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    from sluice.workers.cli import engine_config
    from sluice.workers.engine import LLMEngine

    engine = LLMEngine(engine_config(args, args.model, policy))
    prompts = [p for p, _ in requests]
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in requests]
    engine.generate(prompts[:2], params[:2])  # warm-up outside the timing
    steps_before = engine.scheduler.stats.num_steps
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in results)
    ttfts = sorted(r.first_token_time - r.arrival_time for r in results if r.first_token_time is not None)
    return {"output_tokens": produced, "seconds": elapsed, "output_tokens_per_s": produced / elapsed,
            "steps": engine.scheduler.stats.num_steps - steps_before,
            "preemptions": engine.scheduler.stats.num_preemptions,
            "median_ttft_s": ttfts[len(ttfts) // 2] if ttfts else None}


def scheduler_step_cpu_ms(num_running: int, policy: str = "chunked", steps: int = 50) -> float:
    """CPU milliseconds of schedule() + update() per step with `num_running` decoding requests."""
    from sluice.workers.config import SchedulerConfig
    from sluice.workers.request import Request
    from sluice.workers.scheduler import RunnerOutput, Scheduler

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

    def one_step(now: float) -> None:
        out = scheduler.schedule(now)
        sampled = {c.request.request_id: 1 for c in out.chunks if c.sample}
        scheduler.update(out, RunnerOutput(sampled_token_ids=sampled), now)

    for k in range(4):  # prefill everything, reach steady decode
        one_step(float(k))
    start = time.process_time()
    for k in range(steps):
        one_step(100.0 + k)
    return (time.process_time() - start) * 1000 / steps


def run_bench(args: argparse.Namespace) -> int:
    from sluice.workers.model.config import ModelConfig

    if args.num_requests < 1 or args.hf_batch_size < 1:
        raise CLIError("--num-requests and --hf-batch-size must be positive")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        raise CLIError(f"--policies must be a comma-separated subset of {', '.join(POLICIES)}")
    try:
        sizes = [int(s) for s in args.scheduler_sizes.split(",") if s.strip()]
    except ValueError:
        raise CLIError("--scheduler-sizes must be comma-separated integers") from None
    if not Path(args.model).is_dir():
        raise CLIError(f"model directory {args.model} does not exist")
    if args.threads < 0:
        raise CLIError("--threads must be 0 (all cores) or positive")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    vocab = ModelConfig.from_dir(Path(args.model)).vocab_size
    requests = make_requests(args.num_requests, args.seed, args.prompt_len, args.output_len, vocab)
    report: dict[str, Any] = {
        "config": {"num_requests": args.num_requests, "seed": args.seed, "device": args.device,
                   "threads": torch.get_num_threads(), "prompt_tokens": sum(len(p) for p, _ in requests),
                   "output_tokens": sum(o for _, o in requests), "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   # Shared machines: a high load average marks the numbers as noisy.
                   "load_average_at_start": os.getloadavg()[0]},
        "sluice": {},
    }
    if not args.skip_hf:
        report["hf_static"] = run_hf_static(args.model, requests, args.hf_batch_size, args.device)
        print(f"hf_static        {report['hf_static']['output_tokens_per_s']:10.1f} output tok/s")
    for policy in policies:
        result = run_sluice(args, policy, requests)
        report["sluice"][policy] = result
        print(f"sluice {policy:<13} {result['output_tokens_per_s']:10.1f} output tok/s "
              f"({result['steps']} steps, {result['preemptions']} preemptions)")
    if "hf_static" in report:
        base = report["hf_static"]["output_tokens_per_s"]
        report["speedup_vs_hf"] = {p: r["output_tokens_per_s"] / base for p, r in report["sluice"].items()}
        for p, ratio in report["speedup_vs_hf"].items():
            print(f"speedup {p:<13} {ratio:6.2f}x vs HF static")
    report["scheduler_cpu_ms_per_step"] = {str(n): scheduler_step_cpu_ms(n) for n in sizes}
    for n, ms in report["scheduler_cpu_ms_per_step"].items():
        print(f"scheduler step with {n:>4} running: {ms:.3f} ms CPU")
    report["config"]["load_average_at_end"] = os.getloadavg()[0]
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0
