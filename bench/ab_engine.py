"""A/B one engine lever inside one process: rounds alternate lever off / on on the same requests.

    python bench/ab_engine.py --model var/models/smollm2-135m-instruct --lever pack \
        --num-requests 16 --rounds 3 [--threads 1] [--num-kv-blocks 4096]

On a shared machine two processes run minutes apart see different loads; alternating the lever
within one engine (same weights, same KV pool, same requests) puts both sides in the same
minutes. Each round runs the whole seeded request set (the engine bench's lengths, greedy,
ignore_eos) once with the lever off and once on, in alternating order, and prints both
throughputs; the summary is the median of each side and the median per-round ratio (on / off).
The tokens of both sides are compared too: a lever that changes them is reported.

Levers:
  pack           pre-packed oneDNN weights (kernels/linear.py pack_weight) vs the plain weights
  decode-kernel  the gather-free CPU decode kernel (kernels/cpu_decode.py) vs the torch path
  gemv-kernel    the skinny projections of 1-4 rows (kernels/cpu_gemv.py) vs oneDNN's packed GEMM
  openmp         the native kernels as built (-fopenmp: at::parallel_for on every thread) vs the
                 same sources built without -fopenmp (every parallel_for on one thread)
  speculation    prompt-lookup drafts (workers/speculative.py, the engine's default of 4) vs none

`--chat` runs bench/batch_invariance.py's 16 chat prompts (English questions and summaries, the
chat template applied) to their own end (EOS or --chat-max-tokens) instead of the random-token set:
text that repeats itself far less than a small model's continuation of random ids.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_run import add_engine_run_args, engine_run

from sluice.kernels import cpu_build, cpu_decode, cpu_gemv, native
from sluice.kernels.cpu_build import NativeKernel
from sluice.protocol import SamplingParams
from sluice.workers.engine import LLMEngine
from sluice.workers.model.llama import Linear


def _pack_lever(engine: LLMEngine) -> Callable[[bool], None]:
    model = engine.runner.model

    def set_on(on: bool) -> None:
        if on:
            model.pack_weights()
            return
        for module in model.modules():
            if isinstance(module, Linear):
                module.packed = None
        model._packed_head = None

    return set_on


def _switch_lever(kernel: NativeKernel) -> Callable[[LLMEngine], Callable[[bool], None]]:
    """A native kernel on or off through its switch (the engine asks `KERNEL.ready()` each step)."""
    def lever(engine: LLMEngine) -> Callable[[bool], None]:
        if not kernel.build():
            raise SystemExit(f"{kernel.name} cannot be built here")

        def set_on(on: bool) -> None:
            os.environ[kernel.switch] = "1" if on else "0"

        return set_on

    return lever


def _speculation_lever(engine: LLMEngine) -> Callable[[bool], None]:
    lookup = engine.scheduler.prompt_lookup
    if lookup is None:
        raise SystemExit("the engine was built with speculation off (num_speculative_tokens = 0)")
    drafts = lookup.num_tokens

    def set_on(on: bool) -> None:
        lookup.num_tokens = drafts if on else 0

    return set_on


def _openmp_lever(engine: LLMEngine) -> Callable[[bool], None]:
    from torch.utils.cpp_extension import load

    if not all(native.build_all().values()):
        raise SystemExit("the native CPU kernels cannot be built here")
    built: dict[str, Any] = {key: kernel.module for key, kernel in native.KERNELS.items()}
    serial: dict[str, Any] = {}
    flags = [flag for flag in cpu_build.COMPILE_FLAGS if flag != "-fopenmp"]
    for key, kernel in native.KERNELS.items():
        print(f"building {kernel.name} without -fopenmp ...", flush=True)
        serial[key] = load(name=f"{kernel.name}_serial", sources=[str(kernel.source)],
                           build_directory=tempfile.mkdtemp(prefix="ab-serial-"), extra_cflags=flags)

    def set_on(on: bool) -> None:
        for key, kernel in native.KERNELS.items():
            kernel.module = (built if on else serial)[key]

    return set_on


LEVERS: dict[str, Callable[[LLMEngine], Callable[[bool], None]]] = {
    "pack": _pack_lever, "decode-kernel": _switch_lever(cpu_decode.KERNEL),
    "gemv-kernel": _switch_lever(cpu_gemv.KERNEL), "openmp": _openmp_lever,
    "speculation": _speculation_lever}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_run_args(parser, num_requests=16, threads=1)
    parser.add_argument("--lever", choices=sorted(LEVERS), required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="chat prompts to their end, not random ids")
    parser.add_argument("--chat-max-tokens", type=int, default=256)
    args = parser.parse_args()
    extra = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    engine, prompts, params = engine_run(args, **extra)
    if args.chat:
        from batch_invariance import chat_prompts

        prompts = chat_prompts(args.model)
        params = [SamplingParams(max_tokens=args.chat_max_tokens, temperature=0.0)] * len(prompts)
    set_on = LEVERS[args.lever](engine)
    rates: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[list[int]]] = {}
    stats = engine.scheduler.stats
    for on in (False, True):  # warm-up each side outside the timing
        set_on(on)
        engine.generate(prompts[:2], params[:2])
    for r in range(args.rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            set_on(on)
            start = time.perf_counter()
            steps, drafts, kept = stats.num_steps, stats.num_draft_tokens, stats.num_accepted_draft_tokens
            results = engine.generate(prompts, params)
            elapsed = time.perf_counter() - start
            produced = sum(len(x.token_ids) for x in results)
            rates[on].append(produced / elapsed)
            tokens.setdefault(on, [list(x.token_ids) for x in results])
            print(f"round {r + 1} lever {'on ' if on else 'off'} {produced / elapsed:8.1f} tok/s "
                  f"({elapsed:.1f} s, {produced} tokens, {stats.num_steps - steps} steps, "
                  f"{stats.num_accepted_draft_tokens - kept}/{stats.num_draft_tokens - drafts} drafts kept, "
                  f"load {Path('/proc/loadavg').read_text().split()[0]})", flush=True)
    ratios = [b / a for a, b in zip(rates[False], rates[True], strict=True)]
    off, on_ = statistics.median(rates[False]), statistics.median(rates[True])
    same = sum(a == b for a, b in zip(tokens[False], tokens[True], strict=True))
    print(f"lever {args.lever}: median off {off:.1f} tok/s, on {on_:.1f} tok/s, ratio of medians "
          f"{on_ / off:.3f}, median per-round ratio {statistics.median(ratios):.3f}; "
          f"{same}/{len(prompts)} requests' tokens identical between the sides")
    return 0


if __name__ == "__main__":
    sys.exit(main())
