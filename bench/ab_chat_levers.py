"""A/B of issue #34's engine levers on the chat workload, one process, interleaved rounds.

    python bench/ab_chat_levers.py --model var/models/smollm2-135m-instruct --num-requests 32 --rounds 2

Variants, each a fresh engine on the same seeded chat requests (sluice_lab/workloads.py):
  before       the full-vocabulary sort for every sampled row, speculation's flat keep-chance bar
  after        the candidate sampler (workers/candidates.py) and the batch-dependent bar (the defaults)
  after, off   the same with speculation off
Reports output tokens per second and per CPU second of each run (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from sluice.workers import candidates, sampler
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine
from sluice.workers.model.config import ModelConfig
from sluice_lab.engine_bench import DEFAULT_OUTPUT_LEN, DEFAULT_PROMPT_LEN
from sluice_lab.loadgen.prompts import LengthDist
from sluice_lab.workloads import make_workload


@contextmanager
def full_sort() -> Iterator[None]:
    """The sampler as before issue #34: no row decided by its candidates."""
    def undecided(scaled: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = scaled.shape[0]
        return torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.bool)

    sampler.sample_from_candidates = undecided  # type: ignore[assignment]
    try:
        yield
    finally:
        sampler.sample_from_candidates = candidates.sample_from_candidates


def run(model: str, variant: str, prompts: list[list[int]], params: list) -> dict[str, float]:
    engine = LLMEngine(EngineConfig(model=model, num_speculative_tokens=0 if variant == "after, off" else None))
    lookup = engine.scheduler.prompt_lookup
    if variant == "before" and lookup is not None:
        lookup.knee_rows = 0  # the flat bar
    engine.generate(prompts[:2], params[:2])
    stats = engine.scheduler.stats
    drafted, kept = stats.num_draft_tokens, stats.num_accepted_draft_tokens
    start, cpu = time.perf_counter(), time.process_time()
    if variant == "before":
        with full_sort():
            results = engine.generate(prompts, params)
    else:
        results = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    produced = sum(len(r.token_ids) for r in results)
    return {"output_tokens": produced, "seconds": wall, "cpu_seconds": cpu, "output_tokens_per_s": produced / wall,
            "output_tokens_per_cpu_s": produced / cpu, "draft_tokens": stats.num_draft_tokens - drafted,
            "accepted_draft_tokens": stats.num_accepted_draft_tokens - kept}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab = ModelConfig.from_dir(Path(args.model)).vocab_size
    workload = make_workload(args.workload, args.model, args.num_requests, 0, LengthDist.parse(DEFAULT_PROMPT_LEN),
                             LengthDist.parse(DEFAULT_OUTPUT_LEN), vocab)
    prompts, params = [p for p, _ in workload.requests], workload.sampling_params()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": [], "after, off": []}
    for round_index in range(args.rounds):
        for variant in runs:
            result = run(args.model, variant, prompts, params)
            runs[variant].append(result)
            print(f"round {round_index} {variant:<11} {result['output_tokens_per_s']:7.1f} tok/s "
                  f"{result['output_tokens_per_cpu_s']:7.1f} tok/CPU-s "
                  f"({result['accepted_draft_tokens']}/{result['draft_tokens']} drafts kept)", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"workload": workload.summary(), "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
