"""The gateway's TTFT prediction from a worker's reported step cost and backlog (torch-free).

Hand-made coefficients: a step costs 10 ms fixed, 1 ms per 10 prefill tokens (0.1 s per 1000,
the scaled unit) and 5 ms per decoding row (0.5 s per 100 rows); context and attention pairs are
free unless a test says otherwise.
"""

from __future__ import annotations

import pytest

from sluice.gateway.dispatch.ttft import WorkerLoad, predict_ttft, step_seconds
from sluice.protocol import STEP_COST_FEATURES, Priority, WorkerCapacity

pytestmark = pytest.mark.unit

COST = (0.010, 0.1, 0.5, 0.0, 0.0, 0.0)


def load(backlog: tuple[int, ...] = (0, 0, 0), rows: int = 0, budget: int = 1000,
         cost: tuple[float, ...] = COST) -> WorkerLoad:
    return WorkerLoad(step_cost=cost, prefill_backlog=backlog, decode_rows=rows, step_tokens=budget)


def test_an_idle_worker_prefills_the_prompt_in_budget_sized_steps() -> None:
    # 2500 tokens = steps of 1000, 1000, 500: 3 x 10 ms fixed + 250 ms of prefill.
    assert predict_ttft(load(), priority=Priority.STANDARD, prompt_tokens=2500) == pytest.approx(0.28)


def test_decoding_streams_slow_every_step() -> None:
    # 4 rows x 5 ms in each of the 3 steps.
    assert predict_ttft(load(rows=4), priority=Priority.STANDARD, prompt_tokens=2500) == pytest.approx(0.34)


def test_cached_prefix_tokens_are_not_prefilled() -> None:
    # 2000 of 2500 cached: one step of 500.
    assert predict_ttft(load(), priority=Priority.STANDARD, prompt_tokens=2500,
                        cached_tokens=2000) == pytest.approx(0.06)
    # Fully cached: the last token is still computed (one step of one token).
    assert predict_ttft(load(), priority=Priority.STANDARD, prompt_tokens=2500,
                        cached_tokens=2500) == pytest.approx(0.0101)


def test_only_the_backlog_of_its_class_and_more_urgent_ones_is_ahead() -> None:
    busy = load(backlog=(1000, 3000, 50_000))
    # Interactive: 1000 ahead + 500 own = steps of 1000 and 500.
    assert predict_ttft(busy, priority=Priority.INTERACTIVE, prompt_tokens=500) == pytest.approx(0.17)
    # Standard: 4000 ahead + 500 own = 4.5 steps' worth, 5 steps.
    assert predict_ttft(busy, priority=Priority.STANDARD, prompt_tokens=500) == pytest.approx(0.5)
    # The gateway's own queue ahead of it counts too.
    assert predict_ttft(busy, priority=Priority.INTERACTIVE, prompt_tokens=500,
                        queued_ahead=1000) == pytest.approx(0.28)


def test_the_backlog_shares_a_step_with_the_prompt_and_the_fixed_cost_is_paid_once() -> None:
    # 300 ahead + 300 own fit one step of 1000: 10 ms + 60 ms.
    assert predict_ttft(load(backlog=(300, 0, 0)), priority=Priority.INTERACTIVE,
                        prompt_tokens=300) == pytest.approx(0.07)


def test_attention_pairs_make_a_long_prompts_later_chunks_dearer() -> None:
    cost = (0.0, 0.0, 0.0, 0.0, 0.0, 1.0)  # 1 s per million query x key pairs
    # Chunks of 1000 at 0 and 1000: 1000 * 500.5 + 1000 * 1500.5 pairs = 2.001 M.
    assert predict_ttft(load(cost=cost), priority=Priority.BATCH, prompt_tokens=2000) == pytest.approx(2.001)
    assert step_seconds(cost, prefill_tokens=1000, start=1000, decode_rows=0) == pytest.approx(1.5005)


def test_a_worker_without_a_warm_cost_model_is_not_predicted() -> None:
    base = dict(worker_id="w", num_running=0, num_waiting=0, free_kv_blocks=1, total_kv_blocks=1,
                max_num_seqs=4, sent_at=0.0)
    assert WorkerLoad.of(WorkerCapacity(**base)) is None  # type: ignore[arg-type]
    assert WorkerLoad.of(WorkerCapacity(**base, step_cost=COST)) is None  # type: ignore[arg-type]  # no budget
    warm = WorkerLoad.of(WorkerCapacity(**base, step_cost=COST, max_num_batched_tokens=512,  # type: ignore[arg-type]
                                        prefill_backlog=(1, 2, 3)))
    assert warm is not None and warm.step_tokens == 512 and warm.ahead(Priority.STANDARD) == 3
    assert len(COST) == len(STEP_COST_FEATURES)
