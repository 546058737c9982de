"""`sluice bench engine --kv-events-ab`: does reporting KV events cost the engine throughput? (issue #33)

One engine, the same requests, interleaved rounds with event reporting on and off. "On" does what
a worker does each step (workers/engine_host.py, workers/server.py): take the step's `KvEvents` from
the block manager and encode them as a frame. Requests share per-tenant prefixes and the KV pool
is small enough to evict, so every step both stores and evicts blocks: the worst case for events.
The prefix cache is reset before each run, so both arms do the same work.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from sluice.protocol import SamplingParams, encode_frame


def _requests(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(vocab // 4, vocab) for _ in range(256)] for _ in range(8)]
    return [rng.choice(prefixes) + [rng.randrange(vocab // 4, vocab) for _ in range(rng.randint(16, 128))]
            for _ in range(args.num_requests)]


def _run_once(engine: Any, prompts: list[list[int]], output_len: int, events: bool) -> dict[str, float]:
    from sluice.workers.engine import GenerationResult, accumulate

    engine.scheduler.block_manager.reset_prefix_cache()
    engine.enable_kv_events(events)
    engine.take_kv_events()  # the reset's "cleared" is not part of the timed run
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    results: dict[str, GenerationResult] = {}
    now = time.time()
    for i, prompt in enumerate(prompts):
        rid = f"ab-{events}-{time.monotonic_ns()}-{i}"
        engine.add_request(rid, prompt, params, cache_salt=f"t{i % 8}", arrival_time=now)
        results[rid] = GenerationResult(rid, prompt, arrival_time=now)
    frames = num_hashes = 0
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_work:
        for delta in engine.step():
            accumulate(results[delta.request_id], delta)
        if events:
            batch = engine.take_kv_events()
            if batch is not None:
                encode_frame(batch)
                frames += 1
                num_hashes += len(batch.stored) + len(batch.evicted)
    elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    produced = sum(len(r.token_ids) for r in results.values())
    return {"output_tokens": produced, "seconds": elapsed, "output_tokens_per_s": produced / elapsed,
            "cpu_seconds": cpu_s, "output_tokens_per_cpu_s": produced / cpu_s if cpu_s else 0.0,
            "event_frames": frames, "event_hashes": num_hashes}


def run_kv_events_ab(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    from sluice.workers.engine import LLMEngine

    engine = LLMEngine(config)
    prompts = _requests(args, engine.model_config.vocab_size)
    _run_once(engine, prompts, args.kv_events_output_len, False)  # warm-up (kernels, caches) outside the timing
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for rnd in range(max(3, args.repeat)):
        for arm in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
            run = _run_once(engine, prompts, args.kv_events_output_len, arm == "on")
            runs[arm].append(run)
            print(f"kv events {arm:>3}: {run['output_tokens_per_s']:.1f} tok/s, "
                  f"{run['output_tokens_per_cpu_s']:.1f} tok/CPU-s, {run['event_hashes']} hashes")

    def median(arm: str, key: str) -> float:
        values = sorted(r[key] for r in runs[arm])
        return values[len(values) // 2]

    return {
        "kv_events_ab": {
            "runs": runs, "num_kv_blocks": engine.runner.num_kv_blocks,
            "median_tokens_per_s": {arm: median(arm, "output_tokens_per_s") for arm in runs},
            "median_tokens_per_cpu_s": {arm: median(arm, "output_tokens_per_cpu_s") for arm in runs},
            "on_over_off_tokens_per_cpu_s": (median("on", "output_tokens_per_cpu_s")
                                             / median("off", "output_tokens_per_cpu_s")),
            "on_over_off_tokens_per_s": median("on", "output_tokens_per_s") / median("off", "output_tokens_per_s"),
        }
    }
