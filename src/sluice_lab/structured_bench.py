"""`sluice bench structured`: what constrained decoding costs the engine (issue #31).

One engine (the real model by default), 64 concurrent chat requests asking for JSON, in three arms:
0%, 50% and 100% of them constrained by a nested JSON Schema (lists of objects, enums, optional
fields). Greedy decoding, so the arms generate the same number of tokens per request: the first
round's 100% arm runs first, and every unconstrained request then gets `max_tokens` = the length its
constrained twin produced there (with `ignore_eos`); the ratio of output tok/s is then the cost of
the grammar alone. Every arm of every round asks about its own documents (the number in each prompt
differs), so each arm prefills its prompts cold, as an extraction job's new documents are; with
one prompt set for all arms, the first arm of a round prefilled while the others found the prompts
in the prefix cache (the 100% arm, always first, was timed against warm arms). Rounds rotate the
arms' order and the medians are reported, with
tokens per CPU-second (the machine may be shared) and the runner's per-step mask figures: mask fill
time (beside the forward pass), the wait for masks after it, and the apply time. Cold and warm
compile times of the schema, and the worst step gap of unconstrained streams while a cold compile
of a large schema runs, complete the report, with the engine's mask cost per step (fill and apply)
at 1, 16 and 64 constrained rows, measured apart (experiments/grammar_libs.py).

With `--peer vllm`, vLLM's CPU build runs the same arms in its own interpreter (sluice_lab/peer.py):
the same prompts and schema through its structured outputs (`disable_any_whitespace`, as sluice's
grammar allows no whitespace the schema does not need: with free whitespace vLLM's greedy outputs
ran to `max_tokens` in newlines, not valid JSON), its unconstrained requests with the lengths of
sluice's constrained twins. It is started once sluice's first 100% arm has given those
lengths, runs its three arms after sluice's in every round, and is frozen while sluice is timed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from sluice.errors import CLIError
from sluice.protocol import SamplingParams, StructuredOutput
from sluice_lab import peer as bench_peer
from sluice_lab.experiments.grammar_libs import NESTED_SCHEMA, engine_mask_cost

SUBJECTS = ["a hardware store order", "a bakery delivery", "a bicycle repair", "an office supply restock",
            "a garden centre purchase", "a plumbing job", "a school book order", "a cafe's weekly supplies"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local Hugging Face model directory (e.g. SmolLM2)")
    parser.add_argument("--json", dest="json_out", type=Path, default=Path("structured.json"))
    parser.add_argument("--num-requests", type=int, default=64, help="concurrent requests per arm")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three arms")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--no-kernel-build", action="store_true",
                        help="use the native CPU kernels only if they are already built (no C++ compile)")
    bench_peer.add_peer_arguments(parser)
    parser.add_argument("--peer-structured-backend", default=None,
                        help="vLLM's structured outputs backend (xgrammar, guidance, ...; default: its own, auto)")


ARMS = ("100%", "0%", "50%")


def _prompts(tokenizer: Any, n: int, first: int = 0) -> list[list[int]]:
    """n requests, documents numbered from `first` (each set of numbers is a set of new documents)."""
    schema_hint = "customer, priority (low/normal/high), items (name, kind, quantity, note), tags, total"
    return [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write {SUBJECTS[i % len(SUBJECTS)]} (number {first + i}) as JSON "
                                     f"with {schema_hint}."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)) for i in range(n)]


def _prompt_sets(tokenizer: Any, n: int, rounds: int) -> dict[str, list[list[int]]]:
    """The prompts of each arm of each round ("100%@0", ...), no two sharing a document."""
    return {f"{name}@{r}": _prompts(tokenizer, n, 1000 * (1 + r * len(ARMS) + a))
            for r in range(rounds) for a, name in enumerate(ARMS)}


def _arm(engine: Any, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    runner = engine.runner
    before = copy.copy(runner.grammar_stats)
    fill_before = runner._masks.fill_s
    steps_before = engine.scheduler.stats.num_steps
    start, cpu_start = time.perf_counter(), time.process_time()
    results = engine.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stats = runner.grammar_stats
    steps = engine.scheduler.stats.num_steps - steps_before
    masked_steps = stats.steps - before.steps
    produced = sum(len(r.token_ids) for r in results)
    return {
        "output_tokens": produced, "seconds": round(elapsed, 3), "output_tokens_per_s": produced / elapsed,
        "cpu_seconds": round(cpu, 3), "output_tokens_per_cpu_s": produced / cpu if cpu else None,
        "steps": steps, "ms_per_step": 1e3 * elapsed / steps if steps else None,
        "masked_steps": masked_steps, "masked_rows": stats.rows - before.rows,
        "mask_fill_ms_per_masked_step": (1e3 * (runner._masks.fill_s - fill_before) / masked_steps
                                         if masked_steps else None),
        "mask_wait_ms_per_masked_step": 1e3 * (stats.wait_s - before.wait_s) / masked_steps if masked_steps else None,
        "mask_apply_ms_per_masked_step": (1e3 * (stats.apply_s - before.apply_s) / masked_steps
                                          if masked_steps else None),
        "finish_reasons": sorted({str(r.finish_reason) for r in results}),
        "_lengths": [len(r.token_ids) for r in results], "_texts": [r.text for r in results],
    }


def _compile_times(engine: Any) -> dict[str, float]:
    compiler = engine.grammar_compiler
    # The first compile also waits for the tokenizer's token table (built once per engine): apart.
    start = time.perf_counter()
    compiler.submit(StructuredOutput(kind="regex", spec="warm-up")).result()
    table = time.perf_counter() - start
    schema = dict(NESTED_SCHEMA, title=f"cold-{time.time_ns()}")  # a spec no cache has seen
    spec = StructuredOutput(kind="json", spec=json.dumps(schema))
    start = time.perf_counter()
    compiler.submit(spec).result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(compiler.submit(spec).result())
    warm = time.perf_counter() - start
    return {"token_table_ms": round(table * 1e3, 1), "cold_compile_ms": round(cold * 1e3, 3),
            "warm_compile_ms": round(warm * 1e3, 4)}


def _stall_during_cold_compile(engine: Any, prompts: list[list[int]]) -> dict[str, float]:
    """Step gaps of unconstrained streams with and without a cold compile of a large schema running."""
    inner = {k: v for k, v in NESTED_SCHEMA.items() if k != "$defs"}
    big = {"$defs": NESTED_SCHEMA["$defs"], "type": "object",
           "properties": {f"field_{i}": copy.deepcopy(inner) for i in range(40)},
           "required": [f"field_{i}" for i in range(40)], "additionalProperties": False}
    plain = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    def worst_gap(with_compile: bool) -> tuple[float, float]:
        for i, prompt in enumerate(prompts[:8]):
            engine.add_request(f"stall-{with_compile}-{i}-{time.time_ns()}", prompt, plain)
        future = None
        compile_s = 0.0
        if with_compile:
            started = time.perf_counter()
            future = engine.grammar_compiler.submit(
                StructuredOutput(kind="json", spec=json.dumps(dict(big, title=str(time.time_ns())))))
        gaps, last = [], time.perf_counter()
        while engine.has_work:
            engine.step()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        if future is not None:
            future.result()
            compile_s = time.perf_counter() - started
        return max(gaps[1:]), compile_s

    quiet, _ = worst_gap(False)
    busy, compile_s = worst_gap(True)
    return {"worst_step_gap_ms_without_compile": round(quiet * 1e3, 2),
            "worst_step_gap_ms_during_cold_compile": round(busy * 1e3, 2),
            "large_schema_cold_compile_ms": round(compile_s * 1e3, 1)}


def _write_partial(path: Path, arms: dict[str, list[dict[str, Any]]], peer_arms: dict[str, list[dict[str, Any]]],
                   measured: dict[str, Any]) -> None:
    """The runs so far (a long run on a shared host keeps what it measured if it is stopped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"partial": True, **measured, "runs": _public(arms), "peer_runs": peer_arms},
                               indent=2) + "\n", encoding="utf-8")


def _constrained_rows(name: str, n: int) -> list[bool]:
    return [name == "100%" or (name == "50%" and i % 2 == 0) for i in range(n)]


def _peer_workloads(prompt_sets: dict[str, list[list[int]]], lengths: list[int],
                    max_tokens: int) -> dict[str, dict[str, Any]]:
    """Every arm of every round for vLLM (sluice_lab/vllm_runner.py), with sluice's prompts:
    constrained requests run free up to max_tokens; unconstrained ones get the lengths of sluice's
    constrained twins."""
    def arm(prompts: list[list[int]], constrained: list[bool]) -> dict[str, Any]:
        requests = [[p, max_tokens if c else n] for p, n, c in zip(prompts, lengths, constrained, strict=True)]
        return {"requests": requests, "temperature": 0.0, "top_p": 1.0, "json_schema": NESTED_SCHEMA,
                "constrained": constrained}

    return {key: arm(prompts, _constrained_rows(key.partition("@")[0], len(prompts)))
            for key, prompts in prompt_sets.items()}


def _peer_round(peer: bench_peer.VllmPeer, order: list[str], r: int,
                peer_arms: dict[str, list[dict[str, Any]]]) -> None:
    """One run of each arm by vLLM; a run keeps how many of its constrained outputs are not valid."""
    for name in order:
        run = peer.call(f"throughput {name}@{r}")
        run["constrained_outputs_not_schema_valid"] = _invalid(run.pop("constrained_texts"))
        peer_arms[name].append(run)


def _invalid(texts: list[str]) -> int:
    """How many texts are not schema-valid JSON (those cut by max_tokens among them)."""
    import jsonschema

    invalid = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), NESTED_SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
    return invalid


def _summary(arms: dict[str, list[dict[str, Any]]], keys: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per arm: the median of each key over the rounds, and the first run's output tokens."""
    def median(runs: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return round(statistics.median(values), 4) if values else None

    return {name: {key: median(runs, key) for key in keys} | {"output_tokens": runs[0]["output_tokens"]}
            for name, runs in arms.items() if runs}


def _ratio(summary: dict[str, dict[str, Any]], arm: str, key: str = "output_tokens_per_s") -> float | None:
    base, value = summary["0%"][key], summary[arm][key]
    return round(value / base, 4) if base and value else None


def _public(arms: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    return {name: [{k: v for k, v in run.items() if not k.startswith("_")} for run in runs]
            for name, runs in arms.items()}


def run_structured(args: argparse.Namespace) -> int:
    import torch

    from sluice.kernels import native
    from sluice.workers.cli import engine_config
    from sluice.workers.engine import LLMEngine

    if args.num_requests < 2 or args.rounds < 1 or args.max_tokens < 8:
        raise CLIError("--num-requests must be at least 2, --rounds positive, --max-tokens at least 8")
    if not Path(args.model).is_dir():
        raise CLIError(f"model directory {args.model} does not exist")
    bench_peer.check_peer_arguments(args)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    # Outside every timing (a C++ compile the first time on a machine).
    kernels = native.build_all(compile_missing=not args.no_kernel_build)
    engine = LLMEngine(engine_config(args, args.model))
    prompts = _prompts(engine.tokenizer, args.num_requests)  # the untimed measurements' (warm-up, stall)
    prompt_sets = _prompt_sets(engine.tokenizer, args.num_requests, args.rounds)
    spec = StructuredOutput(kind="json", spec=json.dumps(NESTED_SCHEMA))
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=spec)
    compile_times = _compile_times(engine)
    stall = _stall_during_cold_compile(engine, prompts)
    mask_cost = engine_mask_cost(engine.tokenizer, engine.runner.model_config.vocab_size, [1, 16, 64], steps=40)
    engine.generate(prompts[:2], constrained)  # warm-up (and the schema's compile) outside the timing

    arms: dict[str, list[dict[str, Any]]] = {"0%": [], "50%": [], "100%": []}
    peer_arms: dict[str, list[dict[str, Any]]] = {"0%": [], "50%": [], "100%": []}
    peer: bench_peer.VllmPeer | None = None
    peer_info: dict[str, Any] = {}
    invalid = 0
    peer_error = ""
    measured = {"compile": compile_times, "stall": stall, "mask_cost_ms_per_step": mask_cost}
    lengths: list[int] = []
    try:
        for r in range(args.rounds):
            # The order rotates; round 0's starts with the 100% arm (the twins' lengths).
            order = [ARMS[(r + i) % len(ARMS)] for i in range(len(ARMS))]
            for name in order:
                rows = _constrained_rows(name, args.num_requests)
                params = [constrained if c else SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)
                          for i, c in enumerate(rows)]
                run = _arm(engine, prompt_sets[f"{name}@{r}"], params)
                if name == "100%":
                    invalid += _invalid(run["_texts"])  # cut by max_tokens: reported
                    lengths = lengths or run["_lengths"]
                arms[name].append(run)
                _write_partial(args.json_out, arms, peer_arms, measured)
            if args.peer == "vllm" and not peer_error:
                try:
                    if peer is None:  # started once the twins' lengths are known; nothing is timed meanwhile
                        max_len = max(len(p) for ps in prompt_sets.values() for p in ps) + args.max_tokens + 1
                        peer = bench_peer.VllmPeer(
                            args.peer_venv, args.model, _peer_workloads(prompt_sets, lengths, args.max_tokens),
                            None, torch.get_num_threads(), max_len, args.peer_speculative_tokens,
                            engine.config.resolved_dtype, args.peer_structured_backend)
                        peer_info = peer.call("info")
                        print(f"vllm {peer_info['version']} loaded in {peer_info['load_seconds']:.0f} s")
                    _peer_round(peer, order, r, peer_arms)
                except CLIError as exc:  # the peer died (its output is on stderr): sluice's figures go on
                    peer_error = str(exc)
                _write_partial(args.json_out, arms, peer_arms, measured)
            print(f"round {r + 1}: " + ", ".join(f"{name} {runs[-1]['output_tokens_per_s']:.1f} tok/s"
                                                  for name, runs in arms.items())
                  + "".join(f", vllm {name} {runs[-1]['output_tokens_per_s']:.1f} tok/s"
                            for name, runs in peer_arms.items() if runs))
    finally:
        if peer is not None:
            peer.close()

    keys = ("output_tokens_per_s", "output_tokens_per_cpu_s", "ms_per_step", "mask_fill_ms_per_masked_step",
            "mask_wait_ms_per_masked_step", "mask_apply_ms_per_masked_step")
    summary = _summary(arms, keys)
    report: dict[str, Any] = {
        "what": "structured outputs: output tok/s at 0/50/100% constrained by a nested JSON Schema",
        "config": {"model": args.model, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
                   "rounds": args.rounds, "threads": torch.get_num_threads(),
                   "policy": engine.config.policy,
                   "speculative_tokens": engine.config.resolved_num_speculative_tokens,
                   "mask_fill_beside_forward": engine.runner._masks.overlap, **kernels,
                   "load_average_at_start": os.getloadavg()[0]},
        "compile": compile_times,
        "mask_cost_ms_per_step": mask_cost,
        "arms": summary,
        "ratio_100_vs_0": _ratio(summary, "100%"),
        "ratio_50_vs_0": _ratio(summary, "50%"),
        "ratio_100_vs_0_per_cpu_s": _ratio(summary, "100%", "output_tokens_per_cpu_s"),
        "constrained_outputs_not_schema_valid": invalid,
        "stall": stall,
        "runs": _public(arms),
    }
    if peer_error:
        report["peer_error"] = peer_error
    if peer_info and peer_arms["0%"]:
        peer_summary = _summary(peer_arms, ("output_tokens_per_s", "output_tokens_per_cpu_s"))
        report["peers"] = {"vllm": {
            "info": peer_info, "arms": peer_summary, "ratio_100_vs_0": _ratio(peer_summary, "100%"),
            "ratio_50_vs_0": _ratio(peer_summary, "50%"),
            "constrained_outputs_not_schema_valid": sum(r["constrained_outputs_not_schema_valid"]
                                                        for runs in peer_arms.values() for r in runs),
            "runs": peer_arms}}
        report["sluice_vs_vllm"] = {arm: round(summary[arm]["output_tokens_per_s"]
                                               / peer_summary[arm]["output_tokens_per_s"], 4) for arm in summary}
    report["config"]["load_average_at_end"] = os.getloadavg()[0]
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: report[k] for k in ("compile", "mask_cost_ms_per_step", "arms", "ratio_100_vs_0",
                                             "ratio_50_vs_0", "ratio_100_vs_0_per_cpu_s",
                                             "constrained_outputs_not_schema_valid", "stall") }
                     | ({"vllm": {k: v for k, v in report["peers"]["vllm"].items() if k != "runs"},
                         "sluice_vs_vllm": report["sluice_vs_vllm"]} if "peers" in report else {}), indent=2))
    return 0
