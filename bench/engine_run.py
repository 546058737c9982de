"""What the in-process engine scripts share (bench/ab_engine.py, bench/profile_engine.py): the
arguments that pick the model and the request set, and the engine and seeded requests they make.

The request set is one of `sluice bench engine`'s workloads (`--workload`, default chat: sampled;
random: greedy), with its length distributions and seed, ignore_eos.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from sluice.protocol import SamplingParams
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine
from sluice.workers.model.config import ModelConfig
from sluice_lab.engine_bench import DEFAULT_OUTPUT_LEN, DEFAULT_PROMPT_LEN
from sluice_lab.loadgen.prompts import LengthDist
from sluice_lab.workloads import WORKLOADS, make_workload


def _length_dist(spec: str) -> str:
    """An argparse type: a bad distribution is a one-line usage error, not a traceback."""
    try:
        LengthDist.parse(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def add_engine_run_args(parser: argparse.ArgumentParser, *, num_requests: int, threads: int) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=num_requests)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=_length_dist, default=DEFAULT_PROMPT_LEN)
    parser.add_argument("--output-len", type=_length_dist, default=DEFAULT_OUTPUT_LEN)
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--workload", choices=WORKLOADS, default="chat")
    parser.add_argument("--speculative-tokens", type=int, default=None, help="default: the engine's")


def engine_run(args: argparse.Namespace, **engine_fields: Any) -> tuple[LLMEngine, list[list[int]],
                                                                        list[SamplingParams]]:
    """The engine (`engine_fields`: more EngineConfig fields), the prompts and their parameters."""
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_dir(Path(args.model))
    workload = make_workload(args.workload, args.model, args.num_requests, args.seed, LengthDist.parse(args.prompt_len),
                             LengthDist.parse(args.output_len), cfg.vocab_size)
    engine_fields.setdefault("num_speculative_tokens", args.speculative_tokens)
    engine = LLMEngine(EngineConfig(model=args.model, num_kv_blocks=args.num_kv_blocks, **engine_fields))
    return engine, [p for p, _ in workload.requests], workload.sampling_params()
