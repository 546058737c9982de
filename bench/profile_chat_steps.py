"""cProfile of the engine's steps on the chat workload while many requests run (issue #34).

    python bench/profile_chat_steps.py --model var/models/smollm2-135m-instruct --num-requests 128 \
        --min-running 64 --steps 60

Adds every request at once, then profiles only the steps taken while at least --min-running
requests run and none waits (sampled decodes at a large batch), and prints where their time went:
cumulative (model, logits, sampler, scheduler, detokenizer) and own time. `--timer cpu` profiles
process CPU time (steadier on a shared host; counts the time other threads spin as well).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch

from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine
from sluice.workers.model.config import ModelConfig
from sluice_lab.engine_bench import DEFAULT_OUTPUT_LEN, DEFAULT_PROMPT_LEN
from sluice_lab.loadgen.prompts import LengthDist
from sluice_lab.workloads import make_workload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--min-running", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60, help="profiled steps, at most")
    parser.add_argument("--speculative-tokens", type=int, default=None, help="default: the engine's")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timer", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab = ModelConfig.from_dir(Path(args.model)).vocab_size
    workload = make_workload(args.workload, args.model, args.num_requests, 0, LengthDist.parse(DEFAULT_PROMPT_LEN),
                             LengthDist.parse(DEFAULT_OUTPUT_LEN), vocab)
    prompts, params = [p for p, _ in workload.requests], workload.sampling_params()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype,
                                    num_speculative_tokens=args.speculative_tokens))
    engine.generate(prompts[:2], params[:2])  # warm-up
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    profile = cProfile.Profile(time.process_time) if args.timer == "cpu" else cProfile.Profile()
    stats = engine.scheduler.stats
    drafted, kept = stats.num_draft_tokens, stats.num_accepted_draft_tokens
    steps, wall, cpu = 0, 0.0, 0.0
    while engine.has_work and steps < args.steps:
        if engine.scheduler.num_running >= args.min_running and engine.scheduler.num_waiting == 0:
            start, cpu_start = time.perf_counter(), time.process_time()
            profile.enable()
            engine.step()
            profile.disable()
            wall += time.perf_counter() - start
            cpu += time.process_time() - cpu_start
            steps += 1
        else:
            engine.step()
    print(f"{steps} steps with >= {args.min_running} running: {1e3 * wall / max(steps, 1):.1f} ms wall and "
          f"{1e3 * cpu / max(steps, 1):.1f} ms CPU a step; drafts kept "
          f"{stats.num_accepted_draft_tokens - kept}/{stats.num_draft_tokens - drafted}")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
