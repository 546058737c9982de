"""The adaptive chunk policy (workers/step_budget.py, scheduler.py): with a hand-made cost model the
scheduler picks the documented prefill budget, keeps a long prompt progressing under a target no
step can meet, and gives the whole budget when no latency-sensitive stream decodes; the online model
recovers a linear step-time law from measured steps. Torch-free, hand-made runner outputs."""

from __future__ import annotations

import math
import random

import pytest

from sluice.protocol import SamplingParams
from sluice.workers.config import EngineConfig, SchedulerConfig
from sluice.workers.request import Request
from sluice.workers.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from sluice.workers.step_budget import ITL_HEADROOM, MIN_STEPS, StepCostModel, StepShape, prefill_budget

pytestmark = pytest.mark.unit

# Hand-made model, in the scaled units of step_budget.FEATURES: 10 ms per step, 1 ms per prefill
# token (1.0 s per 1000), 2 ms per decode row (0.2 s per 100), nothing else.
FIXED_S, PER_PREFILL_S, PER_DECODE_S = 0.010, 0.001, 0.002
HAND_MADE = (FIXED_S, 1.0, 0.2, 0.0, 0.0, 0.0)
BUDGET = 512
FLOOR = 16


def make(chunk_policy: str = "adaptive", cost_model: StepCostModel | None = None, slow_share: float = 0.0) -> Scheduler:
    config = SchedulerConfig(policy="chunked", block_size=4, num_kv_blocks=1024, max_num_batched_tokens=BUDGET,
                             max_num_seqs=16, max_model_len=4096, chunk_policy=chunk_policy,
                             min_prefill_chunk=FLOOR, itl_slow_share=slow_share)
    return Scheduler(config, StepCostModel(HAND_MADE) if cost_model is None else cost_model)


def req(rid: str, n_prompt: int, *, itl: float | None, max_tokens: int = 200, ttft: float | None = None) -> Request:
    base = 1000 * (1 + sum(map(ord, rid)))
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=0.0, itl_target_s=itl, ttft_target_s=ttft)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule(0.0)
    s.update(out, RunnerOutput({c.request.request_id: (5,) * c.num_sample_rows for c in out.chunks if c.sample}), 0.0)
    s.check_invariants()
    return out


def prefill_of(out: SchedulerOutput) -> int:
    return sum(c.num_tokens for c in out.chunks if not c.is_decode)


def decoding(s: Scheduler, n: int, itl: float | None) -> None:
    for i in range(n):
        s.add_request(req(f"stream{i}", 4, itl=itl))
    step(s)  # their prompts in one step; each sampled its first token and decodes from now on


def documented_budget(decode_rows: int, itl_s: float) -> int:
    """The rule of step_budget.prefill_budget for the hand-made model, solved by hand."""
    return math.floor((itl_s * ITL_HEADROOM - FIXED_S - decode_rows * PER_DECODE_S) / PER_PREFILL_S + 1e-9)


def test_a_long_prompt_arriving_while_streams_decode_gets_the_documented_budget() -> None:
    s = make()
    decoding(s, 4, itl=0.1)
    s.add_request(req("long", 1000, itl=None))
    out = step(s)
    assert sum(c.is_decode for c in out.chunks) == 4  # the streams keep their token every step
    assert prefill_of(out) == documented_budget(4, 0.1) == 67
    assert s.cost_model.predict(StepShape.of(out)) <= 0.1 * ITL_HEADROOM
    assert s.stats.num_itl_capped_steps == 1


def test_a_prompt_that_would_miss_its_ttft_raises_the_budget_as_far_as_it_needs() -> None:
    """At P prefill tokens a step takes 18 ms + P ms, so 1000 tokens are in time for a 1.1 s target
    when P * 1.1 / (0.018 + 0.001 P) >= 1000, i.e. P >= 180; a 5 s target needs nothing more than the
    ITL budget (67), and a 1.0 s target is lost at any budget, so it does not cost the streams."""
    for ttft, expected in ((5.0, (67, 67)), (1.1, (179, 181)), (1.0, (67, 67))):
        s = make()
        decoding(s, 4, itl=0.1)
        s.add_request(req("long", 1000, itl=None, ttft=ttft))
        assert expected[0] <= prefill_of(step(s)) <= expected[1], ttft


def timed_step(s: Scheduler, now: float) -> tuple[SchedulerOutput, float]:
    """A step that takes what the scheduler's own (hand-made) model predicts; returns it and its end."""
    out = s.schedule(now)
    end = now + s.cost_model.predict(StepShape.of(out))
    s.update(out, RunnerOutput({c.request.request_id: (5,) * c.num_sample_rows for c in out.chunks if c.sample}), end)
    s.check_invariants()
    return out, end


def test_a_percentile_objective_spends_its_slow_gaps_on_whole_budget_steps() -> None:
    """itl_slow_share 0.05 of 101 tokens: 5 slow gaps per stream (of 100). The long prompt's first 5
    steps take the whole budget (508 prefill tokens next to 4 decodes: 526 ms, over the 100 ms
    target), each a gap every stream sees as slow; then the cap holds again (85 ms steps)."""
    s = make(slow_share=0.05)
    for i in range(4):
        s.add_request(req(f"stream{i}", 4, itl=0.1, max_tokens=101))
    _, now = timed_step(s, 0.0)
    s.add_request(req("long", 4000, itl=None))
    sizes = []
    for _ in range(7):
        out, now = timed_step(s, now)
        sizes.append(prefill_of(out))
    assert sizes == [BUDGET - 4] * 5 + [documented_budget(4, 0.1)] * 2
    assert all(s.get_request(f"stream{i}").num_slow_gaps == 5 for i in range(4))  # type: ignore[union-attr]


def test_slow_gaps_the_streams_saw_anyway_spend_the_allowance() -> None:
    """A stalled host (a 1 s gap between steps) costs each stream a slow gap like a whole-budget
    step does, so after 5 stalls no whole-budget step is left; a whole-budget step that comes in
    on time (a loose target) costs nothing."""
    s = make(slow_share=0.05)
    for i in range(4):
        s.add_request(req(f"stream{i}", 4, itl=0.1, max_tokens=101))
    _, now = timed_step(s, 0.0)
    for _ in range(5):
        _, now = timed_step(s, now + 1.0)  # nothing to prefill: decode-only steps after a stall
    s.add_request(req("long", 4000, itl=None))
    assert prefill_of(timed_step(s, now)[0]) == documented_budget(4, 0.1)
    t = make(slow_share=0.05)
    for i in range(4):
        t.add_request(req(f"stream{i}", 4, itl=0.6, max_tokens=101))  # capped at 492; a whole step takes 526 ms
    _, now = timed_step(t, 0.0)
    t.add_request(req("long", 4000, itl=None))
    for _ in range(7):  # the whole prompt but its last 444 tokens
        out, now = timed_step(t, now)
        assert prefill_of(out) == BUDGET - 4 > documented_budget(4, 0.6)
    assert all(t.get_request(f"stream{i}").num_slow_gaps == 0 for i in range(4))  # type: ignore[union-attr]


def test_the_cap_allows_for_how_far_mixed_steps_overran_their_prediction() -> None:
    """Mixed steps measured 1.5x their prediction (at the 95th percentile) lower the cap to what a
    1.5x slower step keeps within the target; decode-only steps do not count."""
    model = StepCostModel(HAND_MADE)
    assert model.overrun() == 1.0
    mixed = StepShape(decode_rows=4).with_prefill(64, 0)
    for i in range(100):
        model.observe(mixed, model.predict(mixed) * (1.5 if i % 10 else 1.0))
        model.observe(StepShape(decode_rows=4), 1.0)  # a wildly slow decode-only step: ignored
    assert model.overrun() == pytest.approx(1.5) and model.overrun(typical=True) == pytest.approx(1.5)
    s = make(cost_model=model)
    decoding(s, 4, itl=0.1)
    s.add_request(req("long", 1000, itl=None))
    assert prefill_of(step(s)) == documented_budget(4, 0.1 / 1.5) == 38


def test_the_tightest_decoding_target_sets_the_budget() -> None:
    s = make()
    decoding(s, 2, itl=0.3)
    s.add_request(req("tight", 4, itl=0.05))
    step(s)  # "tight" is now decoding too
    s.add_request(req("long", 1000, itl=None))
    assert prefill_of(step(s)) == documented_budget(3, 0.05) == 26


def test_the_floor_keeps_a_long_prompt_progressing_under_a_target_no_step_meets() -> None:
    s = make()
    decoding(s, 4, itl=0.001)  # 1 ms: even a decode-only step takes 18 ms
    long = req("long", 1000, itl=None)
    s.add_request(long)
    steps = 0
    while not long.is_decoding:
        out = step(s)
        assert prefill_of(out) == min(FLOOR, 1000 - FLOOR * steps)
        steps += 1
    assert steps == math.ceil(1000 / FLOOR) and long.num_output_tokens == 1


def test_the_whole_budget_when_no_latency_sensitive_stream_decodes() -> None:
    s = make()
    decoding(s, 4, itl=None)  # batch-like streams: no target
    s.add_request(req("long", 1000, itl=None))
    assert prefill_of(step(s)) == BUDGET - 4
    t = make()
    t.add_request(req("long", 1000, itl=0.001))  # a target, but nobody decodes yet
    assert prefill_of(step(t)) == BUDGET


def test_fixed_policy_and_a_cold_model_fill_the_budget() -> None:
    for s in (make("fixed"), make(cost_model=StepCostModel())):
        decoding(s, 4, itl=0.001)
        s.add_request(req("long", 1000, itl=None))
        assert prefill_of(step(s)) == BUDGET - 4
        assert s.stats.num_itl_capped_steps == 0


def test_prefill_budget_bounds() -> None:
    model = StepCostModel(HAND_MADE)
    assert prefill_budget(model, StepShape(), 10.0, start=0, floor=FLOOR, budget=BUDGET) == BUDGET
    assert prefill_budget(model, StepShape(), 1e-6, start=0, floor=FLOOR, budget=BUDGET) == FLOOR
    assert prefill_budget(model, StepShape(), 1e-6, start=0, floor=FLOOR, budget=10) == 10  # floor capped by budget


def test_the_online_model_recovers_a_linear_step_law_and_reports_its_error() -> None:
    truth = StepCostModel((0.004, 0.8, 0.3, 0.05, 0.1, 0.02))
    model = StepCostModel()
    rng = random.Random(7)
    assert not model.ready and model.prediction_error() is None
    for _ in range(600):
        decodes = rng.randint(0, 64)
        shape = StepShape(decode_rows=decodes, context_tokens=decodes * rng.randint(10, 2000),
                          verify_rows=rng.randint(0, 2 * decodes) if decodes else 0)
        if rng.random() < 0.5:
            shape = shape.with_prefill(rng.randint(1, 2048), rng.randint(0, 2000))
        model.observe(shape, truth.predict(shape) * rng.uniform(0.97, 1.03))  # 3% measurement noise
    assert model.ready
    median, p95 = model.prediction_error() or (1.0, 1.0)
    assert median < 0.03 and p95 < 0.06
    probe = StepShape(decode_rows=8, context_tokens=4000).with_prefill(256, 100)
    assert abs(model.predict(probe) - truth.predict(probe)) / truth.predict(probe) < 0.03
    assert MIN_STEPS < 600


def test_an_unexcited_direction_keeps_what_was_learnt() -> None:
    """Hours of decode-only steps after a prefill-rich start do not make prefill look free."""
    truth = StepCostModel(HAND_MADE)
    model = StepCostModel()
    rng = random.Random(3)
    for i in range(2000):
        shape = StepShape(decode_rows=rng.randint(1, 32))
        if i < 200:
            shape = shape.with_prefill(rng.randint(1, 512), 0)
        model.observe(shape, truth.predict(shape))
    assert model.coefficients[1] == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize(("overrides", "message"), [({"chunk_policy": "smart"}, "chunk_policy"),
                                                      ({"min_prefill_chunk": 0}, "min_prefill_chunk"),
                                                      ({"itl_slow_share": 1.0}, "itl_slow_share"),
                                                      ({"itl_slow_share": -0.1}, "itl_slow_share")])
def test_bad_chunk_policy_settings_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **overrides)  # type: ignore[arg-type]


def test_a_bad_itl_target_is_refused() -> None:
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="itl_target_s"):
            req("r", 4, itl=bad)


def test_a_stream_the_whole_budget_step_keeps_in_time_needs_no_slow_gap() -> None:
    """A short answer (max_tokens 8: no slow gap to spend) with a loose 1 s target does not stop
    whole-budget steps (526 ms keeps it in time); with a 0.5 s target it does."""
    for loose_itl, expected in ((1.0, BUDGET - 5), (0.5, documented_budget(5, 0.1))):
        s = make(slow_share=0.05)
        for i in range(4):
            s.add_request(req(f"stream{i}", 4, itl=0.1, max_tokens=101))
        s.add_request(req("short", 4, itl=loose_itl, max_tokens=8))
        _, now = timed_step(s, 0.0)
        s.add_request(req("long", 4000, itl=None))
        assert prefill_of(timed_step(s, now)[0]) == expected, loose_itl


def test_no_whole_budget_step_makes_late_the_prompts_capped_steps_bring_in_time() -> None:
    """Four 100-token prompts with a TTFT target arrive while 4 streams decode under a p95 objective.
    Capped steps (67 prefill tokens, 85 ms) give them first tokens one after another, the first three
    within 0.4 s; one whole-budget step (predicted at the whole budget: 526 ms) would give all four
    theirs at its end, too late: the capped step is taken. With 0.6 s the whole step keeps all four
    in time, and without a target nothing is lost: both prefill all 400 tokens at once."""
    for ttft, expected in ((0.4, documented_budget(4, 0.1)), (0.6, 400), (None, 400)):
        s = make(slow_share=0.05)
        for i in range(4):
            s.add_request(req(f"stream{i}", 4, itl=0.1, max_tokens=101))
        _, now = timed_step(s, 0.0)
        for i in range(4):
            s.add_request(req(f"burst{i}", 100, itl=0.1, ttft=ttft, max_tokens=8))
        assert prefill_of(timed_step(s, now)[0]) == expected, ttft
