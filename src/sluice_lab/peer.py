"""The engine bench's side measurements: a peer engine in its own interpreter, latency points, FLOPs.

- `VllmPeer`: vLLM's CPU build on the same request set, run by `src/sluice_lab/vllm_runner.py` with the
  python of its own virtualenv (`make bench-peers`), loaded once and driven by one-line commands on
  its stdin (results come back as JSON files), so its runs interleave with sluice's and vLLM never
  enters sluice's interpreter.
- `LatencyPoints`: prompts timed to their first token (max 1 output token) and to
  `output_tokens` (by default 128 tokens), for one stream and for several at once, decoded as the
  workload decodes (sampled for chat); TTFT is the first wall time and the mean ITL is
  (full - first) / (tokens - 1). Every engine (HF, sluice, vLLM) is timed this way, from outside,
  so no engine's own accounting is trusted. The two runs use different prompts (chat: different
  conversations; random: different 512-token prompts), so a prefix cache cannot serve the second
  from the first.
- While the bench times sluice, the loaded vLLM peer is frozen (SIGSTOP to its process group; its
  idle worker was seen using ~40% of a core), and it is thawed only for its own commands.
- `matmul_peak`: the machine's measured float32 GEMM rate on the model's own projection shapes,
  and `useful_flops`: the forward FLOPs a request set needs (weights, attention, the head at each
  sampled position), so each engine's achieved FLOP/s can be put against the physical limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.errors import CLIError

if TYPE_CHECKING:  # sluice.workers.model loads torch
    from sluice.workers.model.config import ModelConfig

# The peers' virtualenvs are made by `make bench-peers*` in the checkout (SLUICE_PEERS_DIR elsewhere).
DEFAULT_VLLM_VENV = Path(os.environ.get("SLUICE_PEERS_DIR") or ".peers") / "vllm"
VLLM_RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"  # runs in the peer's interpreter, not ours
DONE_MARKER = "SLUICE-PEER-DONE"  # src/sluice_lab/vllm_runner.py prints it when a command's result is written
Requests = list[tuple[list[int], int]]


@dataclass(frozen=True, slots=True)
class LatencyPoints:
    """Per point name: (prompts timed to the first token, prompts timed to `output_tokens`), decoded
    at `temperature` (0 = greedy) and `top_p`."""

    output_tokens: int
    prompts: dict[str, tuple[list[list[int]], list[list[int]]]]
    temperature: float = 0.0
    top_p: float = 1.0

    @classmethod
    def make(cls, vocab: int, seed: int, prompt_tokens: int, output_tokens: int,
             streams: Sequence[int]) -> LatencyPoints:
        """Random-token prompts of `prompt_tokens`, greedy (the random workload's points)."""
        import torch  # not at the top: see bench_engine (every `sluice` process imports this module)

        gen = torch.Generator().manual_seed(seed + 1)
        low = min(16, vocab - 1)

        def batch(n: int) -> list[list[int]]:
            return torch.randint(low, vocab, (n, prompt_tokens), generator=gen).tolist()

        return cls(output_tokens, {f"streams_{n}": (batch(n), batch(n)) for n in streams})

    @classmethod
    def from_pool(cls, pool: Sequence[list[int]], output_tokens: int, streams: Sequence[int],
                  temperature: float, top_p: float) -> LatencyPoints:
        """Each point takes 2n prompts in turn from `pool` (distinct conversations), n for each run."""
        if len(pool) < 2:
            raise ValueError("latency points need at least two distinct prompts")
        taken = 0

        def batch(n: int) -> list[list[int]]:
            nonlocal taken
            out = [list(pool[(taken + i) % len(pool)]) for i in range(n)]
            taken += n
            return out

        return cls(output_tokens, {f"streams_{n}": (batch(n), batch(n)) for n in streams}, temperature, top_p)

    def longest(self) -> int:
        return max(len(p) for first, _ in self.prompts.values() for p in first) + self.output_tokens

    def time(self, generate: Callable[[list[list[int]], int], object]) -> dict[str, dict[str, float]]:
        """`generate(prompts, max_tokens)` runs to completion; returns TTFT and mean ITL per point.
        One untimed call first: an engine's first call pays one-time set-up (HF's lazy init), which
        would otherwise land in the first TTFT and make that point's ITL come out negative. Its
        prompt is a timed prompt reversed, so no prefix cache serves a timed run from it."""
        out = {}
        warm_first, _ = next(iter(self.prompts.values()))
        generate([warm_first[0][::-1]], 1)
        for name, (first_prompts, full_prompts) in self.prompts.items():
            start = time.perf_counter()
            generate(first_prompts, 1)
            first = time.perf_counter() - start
            start = time.perf_counter()
            generate(full_prompts, self.output_tokens)
            full = time.perf_counter() - start
            out[name] = {"ttft_s": first, "total_s": full,
                         "mean_itl_s": (full - first) / max(self.output_tokens - 1, 1)}
        return out


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a bench that can run vLLM beside sluice (`bench engine`, `bench structured`)."""
    parser.add_argument("--peer", choices=("vllm",), default=None,
                        help="also run this peer engine on the same requests (its own virtualenv)")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_VLLM_VENV,
                        help="the peer's virtualenv (default .peers/vllm, made by `make bench-peers`)")
    parser.add_argument("--peer-speculative-tokens", type=int, default=0,
                        help="run the peer with its own prompt-lookup speculation, this many draft tokens "
                             "(default 0: the peer's defaults, no speculation)")


def check_peer_arguments(args: argparse.Namespace) -> None:
    """Raises CLIError for bad peer flags or a missing peer virtualenv, before anything runs."""
    if args.peer_speculative_tokens < 0:
        raise CLIError("--peer-speculative-tokens must be 0 (off) or positive")
    if args.peer == "vllm":
        vllm_python(args.peer_venv)


def vllm_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise CLIError(f"the vLLM peer's virtualenv {venv} is missing; run `make bench-peers` to create it")
    return python


class VllmPeer:
    """vLLM loaded once in its own interpreter (src/sluice_lab/vllm_runner.py); each call runs one command."""

    def __init__(self, venv: Path, model_dir: str, workloads: dict[str, dict[str, Any]],
                 latency: LatencyPoints | None, threads: int, max_model_len: int, speculative_tokens: int = 0,
                 dtype: str = "float32", structured_backend: str | None = None) -> None:
        """`workloads`: name -> {"requests": [[prompt ids, output tokens], ...], "temperature", "top_p"},
        and for structured outputs "json_schema" and "constrained" (one flag per request);
        `structured_backend`: vLLM's structured outputs backend (None: its default, "auto")."""
        python = vllm_python(venv)
        self._tmp = tempfile.TemporaryDirectory(prefix="sluice-vllm-")
        spec_path = Path(self._tmp.name) / "spec.json"
        spec = {"model": str(Path(model_dir).resolve()), "threads": threads, "max_model_len": max_model_len,
                "speculative_tokens": speculative_tokens, "dtype": dtype, "workloads": workloads,
                "structured_backend": structured_backend,
                "latency_output_tokens": latency.output_tokens if latency else 0,
                "latency_sampling": {"temperature": latency.temperature if latency else 0.0,
                                     "top_p": latency.top_p if latency else 1.0},
                "latency": {name: {"first": f, "full": full}
                            for name, (f, full) in (latency.prompts if latency else {}).items()}}
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        env = {**os.environ, "VLLM_CACHE_ROOT": str(venv / "cache"),
               "TORCHINDUCTOR_CACHE_DIR": str(venv / "inductor"), "OMP_NUM_THREADS": str(threads)}
        env.pop("PYTHONPATH", None)  # sluice's tree must not shadow anything in the peer's interpreter
        # Its own session (process group): the bench freezes and thaws vLLM and its engine-core
        # child together.
        self._proc = subprocess.Popen([str(python), str(VLLM_RUNNER), str(spec_path)], env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        if self._proc.stdin is None or self._proc.stdout is None:
            raise RuntimeError("Popen gave no pipes")
        self._stdin, self._stdout = self._proc.stdin, self._proc.stdout
        self._calls = 0

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, sig)

    def call(self, command: str) -> dict[str, Any]:
        """Sends one command ("info", "throughput WORKLOAD", "latency") and waits for its result.
        The peer runs only inside this call: it is frozen (SIGSTOP) before it returns, so it takes
        no CPU while the bench times sluice."""
        self._signal(signal.SIGCONT)
        try:
            return self._call(command)
        finally:
            self._signal(signal.SIGSTOP)

    def _call(self, command: str) -> dict[str, Any]:
        self._calls += 1
        out = Path(self._tmp.name) / f"result-{self._calls}.json"
        tail: deque[str] = deque(maxlen=15)
        try:
            self._stdin.write(f"{command} {out}\n")
            self._stdin.flush()
        except BrokenPipeError:
            pass  # it died during startup; its output says why
        for line in self._stdout:
            if line.strip() == DONE_MARKER:
                result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
                return result
            tail.append(line.rstrip())
        print("\n".join(tail), file=sys.stderr)
        raise CLIError(f"the vLLM peer failed (exit {self._proc.wait()}); its last output is above")

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        with contextlib.suppress(BrokenPipeError):
            self._stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._tmp.cleanup()


# ---- FLOPs ---------------------------------------------------------------------------------------


def gemm_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection the model runs, plus the head."""
    return {"qkv": (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size), "o": (cfg.q_size, cfg.hidden_size),
            "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size), "down": (cfg.intermediate_size, cfg.hidden_size),
            "lm_head": (cfg.hidden_size, cfg.vocab_size)}


def matmul_peak(cfg: ModelConfig, rows: Sequence[int] = (64, 256, 512), min_seconds: float = 0.2) -> dict[str, Any]:
    """Best float32 GEMM rate of this machine (GFLOP/s) over the model's shapes at a few row counts.

    Each shape is timed on torch's two float32 CPU paths, `F.linear` (MKL) and oneDNN with a
    pre-packed weight (what sluice's engine runs, `kernels.linear`): on a CPU with AVX-512 the
    second is ~2.5x the first at 512 rows, and a peak read off MKL alone would put an engine
    above 100% of it."""
    import torch

    from sluice.kernels.linear import linear, pack_weight

    def rate(gemm: Callable[..., object], *args: object, flop: int) -> float:
        gemm(*args)  # warm-up (oneDNN builds its primitive for the shape here)
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_seconds or calls < 3:
            gemm(*args)
            calls += 1
        return flop * calls / elapsed / 1e9

    rates: dict[str, float] = {}
    for name, (k, n) in gemm_shapes(cfg).items():
        weight = torch.randn(n, k)
        packed = pack_weight(weight)
        for m in rows:
            x = torch.randn(m, k)
            rates[f"{name}[{m}x{k}x{n}]"] = rate(torch.nn.functional.linear, x, weight, flop=2 * m * k * n)
            if packed is not None:
                rates[f"{name}[{m}x{k}x{n}] packed"] = rate(linear, x, weight, None, packed, flop=2 * m * k * n)
    return {"gflops": max(rates.values()), "by_shape_gflops": rates, "threads": torch.get_num_threads()}


def useful_flops(cfg: ModelConfig, requests: Requests) -> float:
    """Forward FLOPs the request set needs: every prompt token and every fed-back output token goes
    through the layers' projections and attends to its context; each output token costs the head once."""
    per_token = 2 * cfg.num_layers * sum(k * n for name, (k, n) in gemm_shapes(cfg).items() if name != "lm_head")
    head = 2 * cfg.hidden_size * cfg.vocab_size
    attn_per_ctx = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # q.k and p.v per context position
    total = 0.0
    for prompt, out in requests:
        tokens = len(prompt) + out - 1
        # Token at position i attends to i + 1 keys: sum over 0..tokens-1.
        total += tokens * per_token + out * head + attn_per_ctx * tokens * (tokens + 1) / 2
    return total
