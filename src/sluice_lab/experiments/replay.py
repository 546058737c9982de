"""Replays timed arrivals into an in-process `LLMEngine` with real wall-clock steps.

The engine-level experiments (policies, chunk sweep) need identical load across engine
configurations: the same prompts arriving at the same offsets. Arrival times are the *scheduled*
ones (start + offset), so a request that could only be added late because a long step was
running is charged that wait in its TTFT, exactly as a client would see it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.protocol import Priority, SamplingParams
from sluice.telemetry import RequestRecord, records_from_results
from sluice.workers.config import EngineConfig
from sluice.workers.engine import GenerationResult, LLMEngine, accumulate


@dataclass(frozen=True, slots=True)
class TimedRequest:
    request_id: str
    offset_s: float  # arrival, seconds after the replay starts
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    role: str = "stream"  # free-form tag the experiment uses to group results
    priority: Priority = Priority.STANDARD
    # (role, n): arrive only once every request of that role has streamed n tokens (and the
    # offset has passed). Ties an arrival to the load's progress rather than to the clock, so
    # "a long prompt arrives while streams decode" holds on a slow CPU and on a fast GPU alike.
    after: tuple[str, int] | None = None
    itl_target_s: float | None = None  # the engine's adaptive chunk policy holds its steps within it
    ttft_target_s: float | None = None  # ... and raises its prefill budget for this one's first token
    temperature: float = 0.0  # 0: greedy; otherwise sampled with top_p and a seed of its own
    top_p: float = 1.0
    seed: int | None = None

    def sampling_params(self) -> SamplingParams:
        """Every request runs to `max_tokens` (ignore_eos), so a phase's shape does not depend on
        where a sampled answer would have stopped."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    records: list[RequestRecord]
    token_times: dict[str, list[float]]  # request id -> engine time of each output token
    roles: dict[str, str]  # request id -> role
    wall_s: float
    num_steps: int


def build_engine(model_dir: Path, *, cpu_threads: int = 1, **overrides: Any) -> LLMEngine:
    """An engine for an experiment. On CPU, torch's intra-op threads are pinned to `cpu_threads`:
    on a shared machine, spinning worker threads that wait for busy cores slow a step down by
    an order of magnitude and make every timing noise (1 thread is the reproducible choice)."""
    settings: dict[str, Any] = {"device": "cpu", "seed": 0, **overrides}
    if settings["device"] == "cpu":
        import torch

        torch.set_num_threads(cpu_threads)
    return LLMEngine(EngineConfig(model=str(model_dir), **settings))


def warm_up(engine: LLMEngine, prompt_len: int) -> None:
    """One throwaway request so lazy initialisation (allocator, kernels) is not measured."""
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([[5] * max(1, prompt_len)], sampling, request_ids=["warmup"])


def replay(engine: LLMEngine, requests: Sequence[TimedRequest], *, model: str = "demo",
           time_limit_s: float = 600.0) -> ReplayResult:
    """Run `requests` to completion, adding each at its offset (or trigger); steps back to back."""
    pending = sorted(requests, key=lambda r: r.offset_s)
    results: dict[str, GenerationResult] = {}
    roles = {r.request_id: r.role for r in pending}
    start = time.time()
    steps = 0

    def due(req: TimedRequest, now: float) -> bool:
        if req.offset_s > now - start:
            return False
        if req.after is None:
            return True
        role, n = req.after
        started = [results[rid] for rid, r in roles.items() if r == role and rid in results]
        return bool(started) and all(len(result.token_ids) >= n for result in started)

    while pending or engine.has_work:
        now = time.time()
        if now - start > time_limit_s:
            raise RuntimeError(f"the replay did not finish within {time_limit_s:.0f} s")
        for req in [r for r in pending if due(r, now)]:
            pending.remove(req)
            # A timed arrival is charged from its scheduled time; a triggered one from now.
            arrival = now if req.after is not None else start + req.offset_s
            engine.add_request(req.request_id, list(req.prompt_token_ids), req.sampling_params(),
                               priority=req.priority, arrival_time=arrival,
                               itl_target_s=req.itl_target_s, ttft_target_s=req.ttft_target_s)
            results[req.request_id] = GenerationResult(req.request_id, list(req.prompt_token_ids),
                                                       arrival_time=arrival)
        if engine.has_work:
            for delta in engine.step():
                if delta.request_id in results:
                    accumulate(results[delta.request_id], delta)
            steps += 1
        elif pending:  # idle: wait for the next timed arrival (a trigger cannot fire while idle)
            time.sleep(max(0.0, start + min(r.offset_s for r in pending) - time.time()))
    wall = time.time() - start
    records = records_from_results(results.values(), model=model)
    return ReplayResult(records=records, token_times={k: v.token_times for k, v in results.items()},
                        roles=roles, wall_s=wall, num_steps=steps)


def token_gaps(result: ReplayResult, role: str | None = None) -> list[float]:
    """Every inter-token gap of the requests with `role` (all when None): ITL over tokens."""
    gaps: list[float] = []
    for rid, times in result.token_times.items():
        if role is None or result.roles.get(rid) == role:
            gaps.extend(b - a for a, b in itertools.pairwise(times))
    return gaps
