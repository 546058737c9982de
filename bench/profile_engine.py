"""Where an engine run's time goes: torch.profiler over `LLMEngine.generate` on the bench's requests.

    python bench/profile_engine.py --model var/models/smollm2-135m-instruct --num-requests 32 \
        [--threads 2] [--top 25] [--trace trace.json]

Same seeded request set as `sluice bench engine` (its length distributions and seed), greedy,
ignore_eos. One engine step in `--every` is profiled (aggregating every step's events of a long
run takes longer than the run); the operators' self CPU time is summed over the profiled steps and
printed as shares, with the wall time of the whole run, so a lever can be judged by the share of
the step it removes. The run also prints the engine thread's CPU time and its run-queue delay:
on a shared host the wall time is their sum, and only the first is the engine's.
Not a test and not a benchmark of record: the profiler's own overhead
inflates small ops.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

from engine_run import add_engine_run_args, engine_run
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from sluice.kernels import native


def _label_native_kernels() -> None:
    """Wraps every native kernel's entry points in a labelled range: pybind calls, which the
    profiler does not see as operators (their time would land in the step's self time)."""
    for kernel in native.KERNELS.values():
        module = sys.modules[kernel.defined_in]
        for name in kernel.entry_points:
            fn: Callable[..., Any] = getattr(module, name)

            @functools.wraps(fn)
            def labelled(*args: Any, _fn: Callable[..., Any] = fn, _label: str = f"native::{name}") -> Any:
                with record_function(_label):
                    return _fn(*args)

            setattr(module, name, labelled)


def run_queue_delay_s() -> float:
    """Seconds this thread has waited, runnable, for a core (Linux schedstat; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_run_args(parser, num_requests=32, threads=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--every", type=int, default=10, help="profile one engine step in this many")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--no-profile", action="store_true", help="time the run only")
    args = parser.parse_args()
    if not args.no_profile:
        _label_native_kernels()
    engine, prompts, params = engine_run(args)
    engine.generate(prompts[:2], params[:2])  # warm-up
    steps = engine.scheduler.stats.num_steps
    self_us: dict[str, float] = {}

    def collect(prof: profile) -> None:
        for event in prof.key_averages():
            self_us[event.key] = self_us.get(event.key, 0.0) + event.self_cpu_time_total

    produced = 0
    start, cpu_start, delay_start = time.perf_counter(), time.thread_time(), run_queue_delay_s()
    now = time.time()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"prof-{i}", prompt, p, arrival_time=now)
    limit = args.max_steps if args.max_steps is not None else float("inf")
    taken = 0
    if args.no_profile:
        while engine.has_work and taken < limit:
            produced += sum(len(d.token_ids) for d in engine.step())
            taken += 1
    else:
        plan = schedule(wait=max(args.every - 2, 0), warmup=1, active=1)
        with profile(activities=[ProfilerActivity.CPU], schedule=plan, on_trace_ready=collect) as prof:
            while engine.has_work and taken < limit:
                produced += sum(len(d.token_ids) for d in engine.step())
                taken += 1
                prof.step()
    elapsed = time.perf_counter() - start
    cpu, delay = time.thread_time() - cpu_start, run_queue_delay_s() - delay_start
    print(f"{produced} output tokens in {elapsed:.1f} s = {produced / elapsed:.1f} tok/s, "
          f"{engine.scheduler.stats.num_steps - steps} steps, "
          f"{engine.scheduler.stats.num_preemptions} preemptions", file=sys.stderr)
    # On a shared host the wall time is the engine's CPU time plus the time it waited for a core.
    print(f"engine thread: {cpu:.1f} s of CPU, {delay:.1f} s waiting for a core (run-queue delay)",
          file=sys.stderr)
    if self_us:
        total = sum(self_us.values())
        print(f"{'operator':<48} {'self ms':>10} {'share':>7}")
        for key, us in sorted(self_us.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{key:<48} {us / 1e3:10.1f} {100 * us / total:6.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
