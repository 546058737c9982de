"""Scheduler: token budget, the three policies, priority preemption, abort, stops, prefix caching.

Runner outputs are made by hand (no torch); every step checks the scheduler's invariants.
"""

from __future__ import annotations

import random
import subprocess
import sys
import zlib
from collections.abc import Callable

import pytest

from sluice.protocol import FinishReason, GenerateRequest, Priority, SamplingParams
from sluice.workers import scheduler as scheduler_module
from sluice.workers.config import EngineConfig, SchedulerConfig
from sluice.workers.request import Request, RequestStatus
from sluice.workers.scheduler import RunnerOutput, Scheduler, SchedulerOutput

pytestmark = pytest.mark.unit

TOKEN = 5  # what the fake runner samples unless a test says otherwise


def make(
    policy: str = "chunked",
    *,
    block_size: int = 4,
    num_kv_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    chunk: int | None = None,
    caching: bool = True,
    speculative: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            policy=policy,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_prefill_chunk=chunk,
            enable_prefix_caching=caching,
            num_speculative_tokens=speculative,
        )
    )


def req(
    rid: str,
    n_prompt: int,
    *,
    max_tokens: int = 4,
    priority: int = Priority.STANDARD,
    arrival: float = 0.0,
    salt: str = "",
    eos: tuple[int, ...] = (),
    tokens: list[int] | None = None,
    **sampling: object,
) -> Request:
    if tokens is None:  # distinct per request id, so no accidental prefix hits
        base = 1000 + zlib.crc32(rid.encode()) % 100_000 * 1000
        tokens = [base + i for i in range(n_prompt)]
    params = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(rid, tokens, params, arrival_time=arrival, priority=priority, cache_salt=salt,
                   eos_token_ids=eos)


def step(
    s: Scheduler, now: float = 0.0, token: Callable[[Request], int] = lambda r: TOKEN,
    agree: Callable[[], bool] = lambda: False,
) -> tuple[SchedulerOutput, list[Request]]:
    """One step with a hand-made runner: each sampling row gets `token(request)`, except that a
    draft's row samples the draft itself (it is verified) where `agree()` says so."""
    out = s.schedule(now)
    assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks)
    sampled = {
        c.request.request_id: tuple(
            c.draft_token_ids[j] if j < len(c.draft_token_ids) and agree() else token(c.request)
            for j in range(c.num_sample_rows))
        for c in out.chunks if c.sample}
    changed = s.update(out, RunnerOutput(sampled), now)
    s.check_invariants()
    return out, changed


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def drain(s: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while s.has_work:
        step(s, now=float(steps))
        steps += 1
        assert steps < max_steps, "the scheduler stopped making progress"
    assert s.num_free_blocks == s.num_total_blocks
    return steps


# ---- configuration and requests ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"policy": "fifo"}, "policy must be one of"),
        ({"block_size": 12}, "power of two"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be a positive integer"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_prefill_chunk": 0}, "max_prefill_chunk"),
    ],
)
def test_scheduler_config_rejects_bad_values(overrides: dict[str, object], message: str) -> None:
    values: dict[str, object] = dict(policy="chunked", block_size=16, num_kv_blocks=8,
                                     max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128)
    values.update(overrides)
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**values)  # type: ignore[arg-type]


def test_engine_config_validation_and_resolution() -> None:
    cfg = EngineConfig(model="/models/tiny")
    assert (cfg.resolved_dtype, cfg.resolved_kernel_backend, cfg.resolved_num_speculative_tokens) == (
        "float32", "torch", 4)
    gpu = EngineConfig(model="/models/tiny", device="cuda:1")
    # Speculation off on CUDA unless asked for: its verification steps run outside the CUDA graphs.
    assert (gpu.resolved_dtype, gpu.resolved_kernel_backend, gpu.resolved_num_speculative_tokens) == (
        "bfloat16", "triton", 0)
    assert EngineConfig(model="m", device="cuda", num_speculative_tokens=3).resolved_num_speculative_tokens == 3
    assert SchedulerConfig.from_engine_config(gpu, 10, 64).num_speculative_tokens == 0
    for bad, message in [
        ({"device": "tpu"}, "device must be"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"cpu_memory_utilization": 0.0}, "cpu_memory_utilization must be in"),
        ({"cpu_memory_utilization": "half"}, "cpu_memory_utilization must be in"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes must be a positive integer"),
        ({"model": ""}, "model must be"),
        ({"kernel_backend": "cutlass"}, "kernel_backend"),
        ({"seed": -1}, "seed"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens must be 0 \\(off\\) or a positive integer"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min must be a positive integer"),
        ({"prompt_lookup_max": "4"}, "prompt_lookup_max must be a positive integer"),
        ({"prompt_lookup_min": 5}, "prompt_lookup_min \\(5\\) must not exceed prompt_lookup_max \\(4\\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**{"model": "/models/tiny", **bad})  # type: ignore[arg-type]
    sched = SchedulerConfig.from_engine_config(EngineConfig(model="m", max_prefill_chunk=4096), 100, 512)
    assert (sched.num_kv_blocks, sched.max_model_len, sched.prefill_chunk) == (100, 512, 2048)


def test_request_basics() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        req("empty", 0, tokens=[])
    with pytest.raises(ValueError, match="max_tokens"):
        req("bad", 3, max_tokens=0)
    assert RequestStatus.FINISHED_LENGTH.finish_reason is FinishReason.LENGTH
    assert not RequestStatus.RUNNING.is_finished and RequestStatus.FINISHED_ABORTED.is_finished
    message = GenerateRequest(request_id="g", tenant_id="t", model="m", priority=Priority.BATCH,
                              prompt_token_ids=(1, 2, 3), sampling=SamplingParams(), cache_salt="s",
                              arrival_time=12.5)
    r = Request.from_generate(message, eos_token_ids=[2])
    assert (r.priority, r.cache_salt, r.arrival_time, r.eos_token_ids) == (2, "s", 12.5, frozenset({2}))
    r.append_output(9, now=13.0)
    assert r.all_token_ids == [1, 2, 3, 9] and r.num_output_tokens == 1 and r.first_token_time == 13.0


def test_add_request_validation() -> None:
    s = make(max_model_len=32, num_kv_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="at most 31 prompt tokens"):
        s.add_request(req("long", 32))
    with pytest.raises(ValueError, match="needs 5 KV blocks but the pool has only 4"):
        s.add_request(req("big", 17))
    s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="already in the engine"):
        s.add_request(req("a", 4))
    assert s.num_waiting == 1


def test_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import sluice.workers.config, sluice.workers.request\n"
        "import sluice.workers.block_manager, sluice.workers.scheduler, sluice.workers.scheduler_output\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- chunked policy ---------------------------------------------------------------------------


def test_budget_accounting_and_chunk_boundaries_inside_blocks() -> None:
    # Chunk cap 6 with blocks of 4: chunks end inside blocks and the table grows as needed.
    s = make(budget=64, chunk=6)
    s.add_request(req("a", 15, max_tokens=2))
    outs = [step(s)[0] for _ in range(3)]
    assert [shape(o) for o in outs] == [[("a", 0, 6)], [("a", 6, 6)], [("a", 12, 3)]]
    assert [len(o.chunks[0].block_ids) for o in outs] == [2, 3, 4]
    assert [o.chunks[0].sample for o in outs] == [False, False, True]
    assert s.get_request("a").num_output_tokens == 1  # type: ignore[union-attr]


def test_decodes_first_then_prefill_fills_the_budget() -> None:
    s = make(budget=10)
    s.add_request(req("a", 4, max_tokens=8, arrival=0))
    s.add_request(req("b", 4, max_tokens=8, arrival=1))
    out, _ = step(s)
    assert shape(out) == [("a", 0, 4), ("b", 0, 4)]
    s.add_request(req("c", 30, max_tokens=8, arrival=2))
    out, _ = step(s)
    # Two decodes first, then c's chunk takes exactly what is left of the budget.
    assert shape(out) == [("a", 4, 1), ("b", 4, 1), ("c", 0, 8)]
    assert out.num_batched_tokens == 10
    assert [c.is_decode for c in out.chunks] == [True, True, False]
    out, _ = step(s)
    assert shape(out) == [("a", 5, 1), ("b", 5, 1), ("c", 8, 8)]


def test_budget_is_never_exceeded_with_many_requests() -> None:
    s = make(budget=16, chunk=8, max_num_seqs=32, num_kv_blocks=256)
    for i in range(12):
        s.add_request(req(f"r{i}", 3 + 5 * i, max_tokens=3 + i % 4, arrival=i))
    while s.has_work:
        out, _ = step(s)
        assert 0 < out.num_batched_tokens <= 16
        assert all(c.num_tokens <= 8 for c in out.chunks)
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
    assert s.num_free_blocks == s.num_total_blocks


def test_partial_prefills_continue_before_new_admissions() -> None:
    s = make(budget=8, chunk=8)
    s.add_request(req("a", 12, arrival=0))
    s.add_request(req("b", 12, arrival=1))
    assert shape(step(s)[0]) == [("a", 0, 8)]
    # a's remaining 4 tokens go first, then b starts with the rest of the budget.
    assert shape(step(s)[0]) == [("a", 8, 4), ("b", 0, 4)]


# ---- prefill_first and static -----------------------------------------------------------------


def test_prefill_first_stalls_decodes_while_prompts_wait() -> None:
    s = make("prefill_first", budget=32)
    s.add_request(req("a", 6, max_tokens=5, arrival=0))
    assert shape(step(s)[0]) == [("a", 0, 6)]
    assert shape(step(s)[0]) == [("a", 6, 1)]
    s.add_request(req("b", 10, max_tokens=5, arrival=1))
    s.add_request(req("c", 10, max_tokens=5, arrival=2))
    # Both prompts whole, no decode for a in that step.
    assert shape(step(s)[0]) == [("b", 0, 10), ("c", 0, 10)]
    assert shape(step(s)[0]) == [("a", 7, 1), ("b", 10, 1), ("c", 10, 1)]


def test_prefill_first_schedules_oversized_prompt_alone() -> None:
    s = make("prefill_first", budget=8)
    s.add_request(req("big", 20, max_tokens=2, arrival=0))
    s.add_request(req("small", 3, max_tokens=2, arrival=1))
    assert shape(step(s)[0]) == [("big", 0, 20)]
    assert shape(step(s)[0]) == [("small", 0, 3)]
    drain(s)


def test_prefill_first_only_whole_prompts_that_fit_the_budget() -> None:
    s = make("prefill_first", budget=10)
    for i, n in enumerate([4, 5, 3]):
        s.add_request(req(f"r{i}", n, arrival=i))
    assert shape(step(s)[0]) == [("r0", 0, 4), ("r1", 0, 5)]  # r2 would exceed the budget
    assert shape(step(s)[0]) == [("r2", 0, 3)]


def test_static_batch_runs_until_every_member_finishes() -> None:
    s = make("static", budget=64, max_num_seqs=2)
    s.add_request(req("a", 4, max_tokens=1, arrival=0))
    s.add_request(req("b", 4, max_tokens=4, arrival=1))
    s.add_request(req("c", 4, max_tokens=1, arrival=2))
    out, changed = step(s)
    assert shape(out) == [("a", 0, 4), ("b", 0, 4)]  # max_num_seqs caps the batch
    assert [r.request_id for r in changed if r.is_finished] == ["a"]
    # a finished, a slot is free, but c waits for the whole batch.
    for expected_start in (4, 5, 6):
        assert shape(step(s)[0]) == [("b", expected_start, 1)]
    assert s.get_request("b") is None
    assert shape(step(s)[0]) == [("c", 0, 4)]


# ---- priority and preemption -----------------------------------------------------------------


def test_resource_preemption_takes_lowest_priority_latest_arrival() -> None:
    # 6 blocks of 4 tokens. Three requests of 8 tokens take 2 blocks each; decoding needs a 3rd.
    s = make(num_kv_blocks=6, budget=64, max_model_len=24)
    s.add_request(req("hi", 8, max_tokens=6, priority=0, arrival=2))
    s.add_request(req("old", 8, max_tokens=6, priority=2, arrival=0))
    s.add_request(req("new", 8, max_tokens=6, priority=2, arrival=1))
    out, _ = step(s)
    assert [c.request.request_id for c in out.chunks] == ["hi", "old", "new"]
    out, _ = step(s)
    # Each needs a new block; only the batch-priority, latest-arrived one is evicted.
    assert out.preempted_ids == ("new",)
    assert shape(out) == [("hi", 8, 1), ("old", 8, 1)]
    preempted = s.get_request("new")
    assert preempted is not None and preempted.status is RequestStatus.WAITING
    assert preempted.num_computed_tokens == 0 and preempted.block_ids == []
    assert preempted.num_preemptions == 1 and s.stats.num_preemptions == 1
    assert preempted.num_output_tokens == 1  # its tokens are kept and recomputed later
    drain(s)


def test_preempted_request_keeps_its_original_arrival_place() -> None:
    s = make(num_kv_blocks=4, budget=64, max_num_seqs=2, max_model_len=16)
    s.add_request(req("first", 8, max_tokens=8, arrival=0))
    s.add_request(req("second", 7, max_tokens=8, arrival=1))
    step(s)
    s.add_request(req("third", 4, max_tokens=2, arrival=2))  # arrives later, same priority
    out, _ = step(s)
    assert out.preempted_ids == ("second",)
    # When room frees up, "second" (arrived before "third") is admitted first.
    admitted: list[str] = []
    while s.has_work:
        out, _ = step(s)
        admitted += [c.request.request_id for c in out.chunks if c.start == 0]
    assert admitted[:2] == ["second", "third"]


def test_waiting_high_priority_preempts_lower_priority_running() -> None:
    s = make(num_kv_blocks=4, budget=64, max_model_len=16)
    s.add_request(req("batch1", 7, max_tokens=8, priority=Priority.BATCH, arrival=0))
    s.add_request(req("batch2", 7, max_tokens=8, priority=Priority.BATCH, arrival=1))
    step(s)
    assert s.num_free_blocks == 0
    s.add_request(req("urgent", 7, max_tokens=2, priority=Priority.INTERACTIVE, arrival=2))
    out, _ = step(s)
    # batch2's decode was scheduled first, then withdrawn when it was preempted for "urgent".
    assert out.preempted_ids == ("batch2",)
    assert shape(out) == [("batch1", 7, 1), ("urgent", 0, 7)]
    assert s.stats.num_priority_preemptions == 1
    drain(s)


def test_equal_priority_waiting_never_preempts() -> None:
    s = make(num_kv_blocks=4, budget=64, max_model_len=16)
    s.add_request(req("a", 7, max_tokens=3, arrival=0))
    s.add_request(req("b", 7, max_tokens=3, arrival=1))
    step(s)
    s.add_request(req("c", 7, max_tokens=3, arrival=2))
    out, _ = step(s)
    assert out.preempted_ids == ()
    assert shape(out) == [("a", 7, 1), ("b", 7, 1)]
    assert s.num_waiting == 1


def test_priority_preemption_frees_sequence_slots() -> None:
    s = make(max_num_seqs=1)
    s.add_request(req("low", 4, max_tokens=5, priority=Priority.BATCH))
    step(s)
    s.add_request(req("high", 4, max_tokens=1, priority=Priority.INTERACTIVE, arrival=1))
    out, changed = step(s)
    assert out.preempted_ids == ("low",)
    assert shape(out) == [("high", 0, 4)]
    assert [r.request_id for r in changed] == ["high"]
    # "low" comes back: its full first block is still cached, so only its 5th token (the one it
    # generated) is recomputed, and its first-schedule hit count stays 0.
    out, _ = step(s)
    assert shape(out) == [("low", 4, 1)]
    low = s.get_request("low")
    assert low is not None and low.num_cached_tokens == 0 and low.num_preemptions == 1
    drain(s)


def test_no_preemption_when_it_would_not_make_room() -> None:
    s = make(num_kv_blocks=4, budget=64, max_model_len=16)
    s.add_request(req("peer", 11, max_tokens=8, priority=Priority.INTERACTIVE, arrival=0))
    s.add_request(req("batch", 3, max_tokens=8, priority=Priority.BATCH, arrival=1))
    step(s)
    # "urgent" needs 3 blocks; evicting "batch" gives only 1 and "peer" has equal priority:
    # preempt nobody rather than preempt for nothing.
    s.add_request(req("urgent", 9, max_tokens=2, priority=Priority.INTERACTIVE, arrival=2))
    out, _ = step(s)
    assert out.preempted_ids == ()
    assert {c.request.request_id for c in out.chunks} == {"peer", "batch"}


def test_request_outgrowing_the_whole_pool_finishes_with_length() -> None:
    s = make(num_kv_blocks=2, block_size=4, max_model_len=64)
    s.add_request(req("a", 6, max_tokens=20))
    finished: list[Request] = []
    for _ in range(10):
        _, changed = step(s)
        finished += [r for r in changed if r.is_finished]
        if not s.has_work:
            break
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].finish_reason is FinishReason.LENGTH
    assert finished[0].num_tokens == 8 + 1  # grew until the 2 blocks were full
    assert s.num_free_blocks == 2


# ---- abort, finish, stops ---------------------------------------------------------------------


def test_abort_in_every_state_frees_blocks_at_once() -> None:
    s = make(budget=8, chunk=8)
    s.add_request(req("prefill", 20, arrival=0))
    s.add_request(req("waiting", 5, arrival=1))
    step(s)
    assert s.get_request("prefill").num_computed_tokens == 8  # type: ignore[union-attr]
    held = s.num_total_blocks - s.num_free_blocks
    assert held == 2
    aborted = s.abort("prefill")
    assert aborted is not None and aborted.status is RequestStatus.FINISHED_ABORTED
    assert aborted.block_ids == [] and s.num_free_blocks == s.num_total_blocks
    s.check_invariants()
    assert s.abort("waiting") is not None
    assert s.abort("unknown") is None
    assert not s.has_work and s.num_waiting == 0
    s.add_request(req("decoding", 4, max_tokens=10))
    step(s)
    step(s)
    assert s.abort("decoding") is not None
    s.check_invariants()
    assert s.num_free_blocks == s.num_total_blocks
    assert step(s)[0].chunks == ()


def test_abort_between_schedule_and_update_is_skipped() -> None:
    s = make()
    s.add_request(req("a", 4))
    s.add_request(req("b", 4))
    out = s.schedule(0.0)
    s.abort("a")
    changed = s.update(out, RunnerOutput({"a": (1,), "b": (2,)}), 0.0)
    assert [r.request_id for r in changed] == ["b"]
    s.check_invariants()


def test_missing_sampled_token_is_an_error() -> None:
    s = make()
    s.add_request(req("a", 4))
    out = s.schedule(0.0)
    with pytest.raises(ValueError, match="no sampled token for request a"):
        s.update(out, RunnerOutput({}), 0.0)


def test_finish_for_stop_strings() -> None:
    s = make()
    s.add_request(req("a", 4, max_tokens=10))
    step(s)
    with pytest.raises(ValueError, match="finished status"):
        s.finish("a", RequestStatus.RUNNING)
    s.finish("a", RequestStatus.FINISHED_STOPPED)
    s.finish("a", RequestStatus.FINISHED_STOPPED)  # already gone: no-op
    assert not s.has_work and s.num_free_blocks == s.num_total_blocks


@pytest.mark.parametrize(
    ("kwargs", "tokens", "status", "num_out"),
    [
        ({"eos": (7,)}, [1, 7, 1], RequestStatus.FINISHED_STOPPED, 2),
        ({"eos": (7,), "ignore_eos": True}, [1, 7, 1, 1], RequestStatus.FINISHED_LENGTH, 4),
        ({"stop_token_ids": (3,)}, [3], RequestStatus.FINISHED_STOPPED, 1),
        ({"stop_token_ids": (3,), "ignore_eos": True}, [1, 3], RequestStatus.FINISHED_STOPPED, 2),
        ({}, [1, 1, 1, 1], RequestStatus.FINISHED_LENGTH, 4),
    ],
)
def test_stop_conditions(
    kwargs: dict[str, object], tokens: list[int], status: RequestStatus, num_out: int
) -> None:
    s = make()
    request = req("a", 5, max_tokens=4, **kwargs)  # type: ignore[arg-type]
    s.add_request(request)
    stream = iter(tokens)
    while s.has_work:
        step(s, token=lambda r: next(stream))
    assert request.status is status and request.num_output_tokens == num_out
    assert len(request.token_times) == num_out
    assert s.num_free_blocks == s.num_total_blocks


def test_max_model_len_stops_generation() -> None:
    s = make(max_model_len=12)
    request = req("a", 9, max_tokens=100)
    s.add_request(request)
    drain(s)
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 12


def test_finished_request_is_reported_once_with_timestamps() -> None:
    s = make()
    s.add_request(req("a", 4, max_tokens=2))
    _, first = step(s, now=1.0)
    _, second = step(s, now=2.0)
    _, third = step(s, now=3.0)
    assert [r.request_id for r in first + second] == ["a", "a"] and third == []
    r = second[0]
    assert r.is_finished and r.first_scheduled_time == 1.0
    assert r.first_token_time == 1.0 and r.token_times == [1.0, 2.0]


# ---- prefix caching --------------------------------------------------------------------------


def test_prefix_cache_hit_on_shared_prefix() -> None:
    s = make(block_size=4)
    system = list(range(500, 516))  # 4 full blocks of shared system prompt
    s.add_request(req("a", 0, tokens=[*system, 1, 2, 3]))
    drain(s)
    b = req("b", 0, tokens=[*system, 9, 9])
    s.add_request(b)
    out, _ = step(s)
    assert shape(out) == [("b", 16, 2)]
    assert b.num_cached_tokens == 16
    assert s.stats.prefix_hit_tokens == 16 and s.stats.prefix_queried_tokens == 19 + 18
    drain(s)


def test_prefix_cache_hit_between_concurrent_requests() -> None:
    s = make(block_size=4, budget=64)
    shared = list(range(700, 712))
    s.add_request(req("a", 0, tokens=[*shared, 1]))
    step(s)
    b = req("b", 0, tokens=[*shared, 2])
    s.add_request(b)
    out, _ = step(s)
    chunk_b = next(c for c in out.chunks if c.request is b)
    a = s.get_request("a")
    assert a is not None and chunk_b.block_ids[:3] == tuple(a.block_ids[:3])
    assert chunk_b.start == 12
    drain(s)


def test_a_request_waits_for_the_prefix_a_running_request_is_prefilling() -> None:
    """Two requests with one long system prompt arriving together: the second is not admitted
    beside the first (it would compute the same blocks again) but waits for them to be cached,
    keeping its place; a request behind it is not held back meanwhile."""
    s = make(block_size=4, budget=200, max_num_seqs=8)
    system = list(range(2000, 2064))  # 16 blocks: MIN_SHARED_PREFILL_TOKENS
    a, b = req("a", 0, tokens=[*system, 1]), req("b", 0, tokens=[*system, 2, 3], arrival=1.0)
    c = req("c", 10, arrival=2.0)
    for r in (a, b, c):
        s.add_request(r)
    out, _ = step(s)
    assert shape(out) == [("a", 0, 65), ("c", 0, 10)] and s.stats.num_shared_prefix_waits == 1
    out, _ = step(s)
    assert shape(out) == [("a", 65, 1), ("c", 10, 1), ("b", 64, 2)]
    assert b.num_cached_tokens == 64 and s.stats.prefix_hit_tokens == 64
    drain(s)


def test_a_request_waits_across_chunks_until_the_shared_run_is_short() -> None:
    """The first request prefills its prompt in chunks: the second waits while 64 or more of its
    tokens are still to be computed by the first, then is admitted with what is cached."""
    s = make(block_size=4, budget=100, chunk=24)
    system = list(range(3000, 3096))  # 24 blocks
    a, b = req("a", 0, tokens=[*system, 1]), req("b", 0, tokens=[*system, 2], arrival=1.0)
    s.add_request(a)
    s.add_request(b)
    starts = []
    while b.status == RequestStatus.WAITING:
        out, _ = step(s)
        starts.append(shape(out))
    # a's chunks of 24 publish 6 blocks a step; b goes in once under 64 of its tokens are pending.
    assert starts[:2] == [[("a", 0, 24)], [("a", 24, 24)]] and starts[2] == [("a", 48, 24), ("b", 48, 24)]
    assert b.num_cached_tokens == 48 and s.stats.num_shared_prefix_waits == 2
    drain(s)


def test_admission_stops_looking_past_max_num_seqs_held_requests() -> None:
    """A thousand requests of one job behind its first: each step passes over at most max_num_seqs
    of them, not the whole queue."""
    s = make(block_size=4, budget=200, max_num_seqs=3, num_kv_blocks=128)
    system = list(range(6000, 6064))
    for i in range(6):
        s.add_request(req(f"j{i}", 0, tokens=[*system, i], arrival=float(i)))
    s.add_request(req("other", 8, arrival=9.0))
    out, _ = step(s)
    assert shape(out) == [("j0", 0, 65)] and s.stats.num_shared_prefix_waits == 3
    out, _ = step(s)  # j0's prompt is cached: j1 and j2 take the two free slots with a hit
    assert shape(out) == [("j0", 65, 1), ("j1", 64, 1), ("j2", 64, 1)]
    drain(s)


def test_no_wait_for_a_prefill_preempted_in_the_same_step() -> None:
    """A batch request prefilling a long prompt in chunks is preempted for an interactive arrival:
    a standard request sharing that prompt is not held back for blocks nobody will compute now."""
    s = make(block_size=4, num_kv_blocks=26, budget=64, chunk=16, max_model_len=160)
    system = list(range(5000, 5096))  # 24 blocks
    s.add_request(req("filler", 60, max_tokens=60, priority=Priority.BATCH))
    for _ in range(4):
        step(s)
    s.add_request(req("a", 0, tokens=[*system, 1], priority=Priority.BATCH, arrival=1.0))
    step(s)
    s.add_request(req("x", 40, priority=Priority.INTERACTIVE, arrival=2.0))
    s.add_request(req("b", 0, tokens=[*system, 2], priority=Priority.STANDARD, arrival=3.0))
    out, _ = step(s)
    # x preempts a; b, not held, takes a's cached first chunk and preempts the batch filler for room.
    assert out.preempted_ids == ("a", "filler") and shape(out) == [("x", 0, 16), ("b", 16, 16)]
    assert s.stats.num_shared_prefix_waits == 0
    drain(s)


@pytest.mark.parametrize(("policy", "system", "salt"), [
    ("chunked", list(range(4000, 4060)), ""),  # 15 shared blocks: under MIN_SHARED_PREFILL_TOKENS
    ("chunked", list(range(4000, 4064)), "other-tenant"),  # another tenant's: no hit to wait for
    ("prefill_first", list(range(4000, 4064)), ""),  # whole prompts only: both in one step
    ("static", list(range(4000, 4064)), ""),  # one batch: waiting would hold b out of it
])
def test_no_wait_for_a_short_prefix_another_tenant_or_whole_prompt_policies(
        policy: str, system: list[int], salt: str) -> None:
    s = make(policy, block_size=4, budget=200)
    s.add_request(req("a", 0, tokens=[*system, 1]))
    s.add_request(req("b", 0, tokens=[*system, 2], salt=salt, arrival=1.0))
    out, _ = step(s)
    assert [c.request.request_id for c in out.chunks] == ["a", "b"] and s.stats.num_shared_prefix_waits == 0
    drain(s)


def test_tenant_salt_isolation() -> None:
    s = make(block_size=4)
    prompt = list(range(300, 317))
    s.add_request(req("a", 0, tokens=prompt, salt="tenant-a"))
    drain(s)
    other = req("b", 0, tokens=prompt, salt="tenant-b")
    same = req("c", 0, tokens=prompt, salt="tenant-a")
    s.add_request(other)
    s.add_request(same)
    step(s)
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 16


def test_prefix_caching_off_never_hits() -> None:
    s = make(caching=False)
    prompt = list(range(300, 317))
    s.add_request(req("a", 0, tokens=prompt))
    drain(s)
    b = req("b", 0, tokens=prompt)
    s.add_request(b)
    step(s)
    assert b.num_cached_tokens == 0 and s.stats.prefix_queried_tokens == 0


# ---- randomized --------------------------------------------------------------------------------


@pytest.mark.parametrize("speculative", [0, 3])
@pytest.mark.parametrize("policy", ["chunked", "prefill_first", "static"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_invariants_and_finishes(policy: str, seed: int, speculative: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    # The shared prefixes here are 4-12 tokens: let one shared block hold a request back (64 in
    # service), so requests passed over for a running prefill's blocks meet every other path.
    monkeypatch.setattr(scheduler_module, "MIN_SHARED_PREFILL_TOKENS", 4)
    # A pool of 64 tokens under a 96-token context: preemption, prefix hits and requests that
    # outgrow the pool all happen; with speculation, drafts are kept and rejected at random.
    s = make(policy, block_size=4, num_kv_blocks=16, budget=24, max_num_seqs=6, max_model_len=96,
             chunk=rng.choice([None, 5, 8]), speculative=speculative)
    if s.prompt_lookup is not None:
        # Acceptance here is a coin, which the learned cut-off could only thin out: every guess
        # goes out, so drafts stay frequent and the coverage checks below hold.
        s.prompt_lookup.min_keep_chance = 0.0
        s.prompt_lookup.knee_rows = 0.0  # nor does the bar rise with the batch
    agree = lambda: rng.random() < 0.7  # noqa: E731
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 12))] for _ in range(3)]
    live: set[str] = set()
    ended: dict[str, RequestStatus] = {}
    submitted: list[Request] = []
    now = 0.0
    for i in range(150):
        now += 1.0
        action = rng.random()
        if action < 0.35:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            r = req(f"r{i}", 0, tokens=prompt[:60], max_tokens=rng.randrange(1, 40),
                    priority=rng.randrange(3), arrival=now, salt=rng.choice(["x", "y"]),
                    eos=(0,), ignore_eos=rng.random() < 0.3)
            s.add_request(r)
            live.add(r.request_id)
            submitted.append(r)
        elif action < 0.42 and live:
            rid = rng.choice(sorted(live))
            aborted = s.abort(rid)
            assert aborted is not None
            live.discard(rid)
            ended[rid] = aborted.status
            s.check_invariants()
        elif action < 0.45 and live:  # the engine matched a stop string
            rid = rng.choice(sorted(live))
            s.finish(rid, RequestStatus.FINISHED_STOPPED)
            live.discard(rid)
            ended[rid] = RequestStatus.FINISHED_STOPPED
            s.check_invariants()
        else:
            _, changed = step(s, now, token=lambda r: rng.randrange(40), agree=agree)
            for r in changed:
                if r.is_finished:
                    assert r.request_id not in ended, "a request was reported finished twice"
                    live.discard(r.request_id)
                    ended[r.request_id] = r.status
    for _ in range(5000):
        if not s.has_work:
            break
        now += 1.0
        _, changed = step(s, now, token=lambda r: rng.randrange(40), agree=agree)
        for r in changed:
            if r.is_finished:
                assert r.request_id not in ended
                ended[r.request_id] = r.status
    assert not s.has_work
    assert {r.request_id for r in submitted} == set(ended)
    assert s.num_free_blocks == s.num_total_blocks
    for r in submitted:
        assert r.is_finished and r.block_ids == []
        assert r.num_output_tokens <= r.sampling.max_tokens and r.num_tokens <= 96
        assert len(r.token_times) == r.num_output_tokens
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens >= 1
    # The workload is tight enough to exercise the hard paths (seeded, so this is deterministic).
    assert s.stats.prefix_hit_tokens > 0
    if policy == "chunked":
        assert s.stats.num_shared_prefix_waits > 0
    if policy != "static":
        assert s.stats.num_preemptions > 0 and s.stats.num_priority_preemptions > 0
    if speculative:
        assert 0 < s.stats.num_accepted_draft_tokens < s.stats.num_draft_tokens


def test_prefill_backlog_counts_tokens_still_to_prefill_by_class() -> None:
    """What a worker reports for the gateway's TTFT prediction (gateway/dispatch/ttft.py)."""
    s = make(budget=64, chunk=32)
    s.add_request(req("i", 100, priority=Priority.INTERACTIVE))
    s.add_request(req("b", 40, priority=Priority.BATCH))
    assert s.prefill_backlog() == (100, 0, 40)
    step(s)  # interactive first: one chunk of 32, then 32 of the batch prompt (budget 64)
    assert s.prefill_backlog() == (68, 0, 8)
    assert s.decode_context() == 0  # nobody decodes yet
    while s.prefill_backlog() != (0, 0, 0):
        step(s)
    assert s.has_work  # decoding: no prefill left to report
    # Both decode, each reading its whole context (prompt and output so far) in every step.
    assert s.decode_context() == sum(r.num_tokens for r in (s.get_request("i"), s.get_request("b")) if r)
    assert s.decode_context() > 140
