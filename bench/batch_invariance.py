"""Does a greedy stream's text depend on what it is batched with? Lone streams vs one busy batch.

A decode step of 1-4 sequences and one of 16 run their projections through different GEMM code
(the skinny kernel or oneDNN's gemv path at a few rows, oneDNN's blocked GEMM at many), which sum
the same float32 products in other orders. A greedy choice whose top-2 logits are that close can
then resolve differently by batch composition. This runs chat prompts (the shape of real traffic,
not random token ids) once each alone and once all together, for each setting of a native
kernel's switch, and reports how many sequences came out identical and where the others first
differ, with the top-2 logit gap the lone run saw there (a float near-tie or not).

`python bench/batch_invariance.py --model var/models/smollm2-135m-instruct --json out.json`
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoTokenizer

from sluice.kernels import native
from sluice.protocol import SamplingParams
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine

CORPUS = (Path(__file__).resolve().parents[1] / "src" / "sluice" / "workers" / "demo_corpus.txt").read_text()
QUESTIONS = [
    "What is the capital of France? Answer in one sentence.", "hi", "List three prime numbers.",
    "Write a haiku about the sea.", "Translate 'good morning' into Spanish and German.",
    "Explain what a queue is to a child.", "Give two reasons to batch requests.", "What is 17 times 23?",
]


def chat_prompts(model: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [*QUESTIONS, *(f"Summarize in one sentence:\n{CORPUS[i * 300:(i + 1) * 300 + 200]}" for i in range(8))]
    prompts = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        prompts.append(list(cast(list[int], ids)))  # tokenize=True, return_dict=False: the ids
    return prompts


_HF: dict[str, Any] = {}


def top2_gap(model: str, prompt: list[int], ids: list[int]) -> float:
    """HF transformers' (float32) top-2 logit gap for the token after prompt + ids: a reference
    independent of either engine path."""
    from transformers import AutoModelForCausalLM

    if model not in _HF:
        _HF[model] = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        top = _HF[model](torch.tensor([prompt + ids])).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def compare(model: str, prompts: list[list[int]], first: list[list[int]], second: list[list[int]]) -> dict[str, Any]:
    differ = []
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        if a != b:
            pos = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
            differ.append({"prompt": i, "position": pos, "top2_gap": round(top2_gap(model, prompts[i], a[:pos]), 6)})
    return {"identical": len(first) - len(differ), "of": len(first), "differ": differ}


def _positive(text: str) -> int:
    """An argparse type: a count of at least 1 (anything else is a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=_positive, default=64)
    parser.add_argument("--threads", type=_positive, default=2)
    parser.add_argument("--switch", default="SLUICE_CPU_GEMV_KERNEL", help="the native kernel switch to flip")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not Path(args.model, "config.json").is_file():
        print(f"batch_invariance: error: {args.model} is not a model directory", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    native.build_all()
    prompts = chat_prompts(args.model)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # No prefix cache: each run computes its own K/V (a batch reusing the lone runs' prompt blocks
    # would not batch its prefill, and the second setting would reuse the first's).
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", max_num_seqs=len(prompts),
                                    enable_prefix_caching=False))
    runs: dict[str, dict[str, list[list[int]]]] = {}
    for setting in ("0", "1"):
        os.environ[args.switch] = setting
        started = time.perf_counter()
        lone = [engine.generate([p], sampling)[0].token_ids for p in prompts]
        batch = [r.token_ids for r in engine.generate(prompts, sampling)]
        runs[setting] = {"lone": lone, "batch": batch}
        print(f"{args.switch}={setting}: ran in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    report = {
        "model": args.model, "switch": args.switch, "prompts": len(prompts), "max_tokens": args.max_tokens,
        "lone_vs_batch": {f"{args.switch}={s}": compare(args.model, prompts, r["lone"], r["batch"])
                          for s, r in runs.items()},
        "on_vs_off": {kind: compare(args.model, prompts, runs["0"][kind], runs["1"][kind])
                      for kind in ("lone", "batch")},
    }
    for name, result in [*report["lone_vs_batch"].items(), *(("off vs on, " + k, v)
                                                             for k, v in report["on_vs_off"].items())]:
        where = ", ".join(f"p{d['prompt']}@{d['position']} (gap {d['top2_gap']:.1e})" for d in result["differ"])
        print(f"{name:34} identical {result['identical']:2}/{result['of']}  {where}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
