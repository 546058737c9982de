"""The gateway's TTFT prediction from a worker's reported step cost and backlog, and from how fast
room appears for the jobs it holds (torch-free).

Hand-made coefficients: a step costs 10 ms fixed, 1 ms per 10 prefill tokens (0.1 s per 1000,
the scaled unit) and 5 ms per decoding row (0.5 s per 100 rows); context and attention pairs are
free unless a test says otherwise.
"""

from __future__ import annotations

import dataclasses
import time

import msgspec
import pytest
from sluice_testing import state_of

from sluice.gateway.dispatch.dispatcher import Dispatcher
from sluice.gateway.dispatch.jobs import Job
from sluice.gateway.dispatch.links.base import EngineLink
from sluice.gateway.dispatch.ttft import RoomPace, WorkerLoad, predict_ttft, step_seconds
from sluice.protocol import STEP_COST_FEATURES, GenerateRequest, Priority, SamplingParams, WorkerCapacity
from sluice.settings import DispatchSettings, Settings

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


def test_the_decoding_streams_kv_reads_slow_every_step() -> None:
    cost = (0.010, 0.1, 0.0, 1.0, 0.0, 0.0)  # 1 s per 100k KV tokens read
    busy = WorkerLoad(step_cost=cost, prefill_backlog=(0, 0, 0), decode_rows=4, step_tokens=1000,
                      decode_context=20_000)
    # 2 steps (1000 + 500 tokens): each 10 ms fixed and 0.2 s of decode reads, once per step; the
    # prompt's own chunks read up to positions 1000 and 1500 (25 ms).
    assert predict_ttft(busy, priority=Priority.STANDARD, prompt_tokens=1500) == pytest.approx(
        0.02 + 0.15 + 0.4 + 0.025)


def test_a_request_sent_to_a_busy_worker_waits_for_the_rest_of_the_step_in_progress() -> None:
    # 4 rows decoding, reported 10 ms ago: that step (10 ms + 4 x 5 ms) has 20 ms left, then a
    # step of its 500 tokens with the 4 rows (10 + 50 + 20 ms).
    decoding = dataclasses.replace(load(rows=4), since_report=0.010)
    assert predict_ttft(decoding, priority=Priority.STANDARD, prompt_tokens=500) == pytest.approx(0.10)
    # Sent later (held at the gateway), or with no age for the report: that step is not counted.
    assert predict_ttft(decoding, priority=Priority.STANDARD, prompt_tokens=500,
                        sent_now=False) == pytest.approx(0.08)
    assert predict_ttft(load(rows=4), priority=Priority.STANDARD, prompt_tokens=500) == pytest.approx(0.08)
    # A report older than one step (steady decoding reports nothing new): the same step's phase.
    stale = dataclasses.replace(decoding, since_report=0.070)  # 0.070 = 2 x 30 ms + 10 ms
    assert predict_ttft(stale, priority=Priority.STANDARD, prompt_tokens=500) == pytest.approx(0.10)
    # An idle worker is in no step.
    idle = dataclasses.replace(load(), since_report=0.010)
    assert predict_ttft(idle, priority=Priority.STANDARD, prompt_tokens=500) == pytest.approx(0.06)


def test_the_step_in_progress_prefills_the_most_urgent_backlog_first() -> None:
    # 600 interactive tokens, reported 20 ms ago: that step (10 + 60 ms) prefills them all and has
    # 50 ms left; an interactive request then has nothing ahead (one step of 10 + 50 ms).
    urgent = dataclasses.replace(load(backlog=(600, 0, 0)), since_report=0.020)
    assert predict_ttft(urgent, priority=Priority.INTERACTIVE, prompt_tokens=500) == pytest.approx(0.11)
    # Without the step's age: 1100 tokens from now, steps of 1000 and 100 (10 + 100 + 10 + 10 ms).
    assert predict_ttft(load(backlog=(600, 0, 0)), priority=Priority.INTERACTIVE,
                        prompt_tokens=500) == pytest.approx(0.13)
    # A batch backlog in that step is not ahead of an interactive request: it waits out the step only.
    batch = dataclasses.replace(load(backlog=(0, 0, 600)), since_report=0.020)
    assert predict_ttft(batch, priority=Priority.INTERACTIVE, prompt_tokens=500) == pytest.approx(0.11)


def test_jobs_sent_since_the_last_report_are_ahead_by_the_class_they_were_sent_as() -> None:
    worker = RecordingLink()
    urgent, batch = job("u").request, job("b").request
    urgent = msgspec.structs.replace(urgent, priority=Priority.INTERACTIVE)
    batch = msgspec.structs.replace(batch, priority=Priority.BATCH)
    for request in (urgent, batch):
        worker.inflight[request.request_id] = job(request.request_id)
        worker.send(request)
    loaded = worker.ttft_load
    assert loaded is not None and loaded.unreported == (500, 0, 500)
    assert loaded.ahead(Priority.INTERACTIVE) == 500 and loaded.ahead(Priority.BATCH) == 1000
    worker.inflight["b"].started = True  # it left the worker's queue: not ahead any more
    assert worker.ttft_load is not None and worker.ttft_load.unreported == (500, 0, 0)
    worker.take_report(msgspec.structs.replace(worker.capacity, num_received=1))  # u is reported now
    assert worker.ttft_load is not None and worker.ttft_load.unreported == (0, 0, 0)


def test_a_link_dates_each_report_it_takes() -> None:
    worker = RecordingLink()
    first = worker.capacity
    newer = msgspec.structs.replace(first, num_running=3)
    before = time.monotonic()
    assert worker.take_report(newer) is first
    assert worker.capacity is newer and before <= worker.reported_at <= time.monotonic()
    loaded = worker.ttft_load
    assert loaded is not None and loaded.decode_rows == 3
    assert loaded.since_report is not None and 0.0 <= loaded.since_report < 60.0


def test_a_worker_without_a_warm_cost_model_is_not_predicted() -> None:
    base = dict(worker_id="w", num_running=0, num_waiting=0, free_kv_blocks=1, total_kv_blocks=1,
                max_num_seqs=4, sent_at=0.0)
    assert WorkerLoad.of(WorkerCapacity(**base)) is None  # type: ignore[arg-type]
    assert WorkerLoad.of(WorkerCapacity(**base, step_cost=COST)) is None  # type: ignore[arg-type]  # no budget
    warm = WorkerLoad.of(WorkerCapacity(**base, step_cost=COST, max_num_batched_tokens=512,  # type: ignore[arg-type]
                                        prefill_backlog=(1, 2, 3), decode_context_tokens=700))
    assert warm is not None and warm.step_tokens == 512 and warm.ahead(Priority.STANDARD) == 3
    assert warm.decode_context == 700
    assert len(COST) == len(STEP_COST_FEATURES)


def test_room_pace_is_the_mean_gap_from_a_send_that_left_jobs_held_to_the_next() -> None:
    pace = RoomPace(window=3)
    assert pace.seconds_per_job("m") is None
    pace.sent("m", 10.0, left_held=False)
    pace.sent("m", 50.0, left_held=True)  # idle between 10 and 50: no gap
    assert pace.seconds_per_job("m") is None
    pace.sent("m", 52.0, left_held=True)
    pace.sent("m", 53.0, left_held=False)
    pace.sent("m", 90.0, left_held=True)  # nothing was held from 53 to 90: no gap
    assert pace.seconds_per_job("m") == pytest.approx(1.5)  # gaps 2 and 1
    pace.sent("m", 94.0, left_held=True)
    pace.sent("m", 100.0, left_held=True)  # the window keeps the last 3: 1, 4, 6
    assert pace.seconds_per_job("m") == pytest.approx(11 / 3)
    assert pace.seconds_per_job("other") is None


class RecordingLink(EngineLink):
    """A worker link whose transport is a list: the dispatcher's room rule and prediction read
    only its reported capacity (the real links: tests/integration/dispatch/test_engine_host.py)."""

    def __init__(self) -> None:
        super().__init__("w", frozenset({"m"}), WorkerCapacity(
            worker_id="w", num_running=0, num_waiting=0, free_kv_blocks=100, total_kv_blocks=100,
            max_num_seqs=8, sent_at=0.0, step_cost=COST, prefill_backlog=(0, 0, 0),
            max_num_batched_tokens=1000), "cpu", 0)
        self.requests: list[GenerateRequest] = []

    def _send(self, request: GenerateRequest) -> None:
        self.requests.append(request)

    def _abort(self, request_id: str) -> None:
        return None

    def close(self) -> None:
        return None


def job(rid: str) -> Job:
    request = GenerateRequest(request_id=rid, tenant_id="t", model="m", priority=Priority.STANDARD,
                              prompt_token_ids=tuple(range(1, 501)), sampling=SamplingParams(max_tokens=4),
                              cache_salt="t", arrival_time=time.time())
    return Job(state=state_of(request), sink=lambda delta: None)


def test_a_request_no_worker_has_room_for_waits_a_room_gap_per_job_held_ahead_and_its_own() -> None:
    dispatcher = Dispatcher(Settings(dispatch=DispatchSettings(max_worker_waiting=1)), lambda job, final: None)
    worker = RecordingLink()
    dispatcher.attach(worker)
    new = job("new").request
    # Idle worker, nothing held: one step of 500 tokens (10 ms + 50 ms).
    assert dispatcher.predicted_ttft(new) == pytest.approx(0.06)
    for rid in ("a", "b", "c"):
        dispatcher.enqueue(job(rid))
    assert dispatcher.dispatch_ready() == 1  # the worker's queue holds one: b and c stay held
    assert [r.request_id for r in worker.requests] == ["a"]
    # No room gap measured yet: the held prompts count as prefill ahead, and so does a, sent and not
    # reported by the worker yet (3 x 500 + 500: 2 steps of 1000).
    assert dispatcher.predicted_ttft(new) == pytest.approx(0.22)
    dispatcher.pace = RoomPace()  # measured: room for one job every 2 s
    dispatcher.pace.sent("m", 0.0, left_held=True)
    dispatcher.pace.sent("m", 2.0, left_held=True)
    # b, c, then itself: 3 gaps, then its own prefill on the worker as it is now (behind a's 500).
    assert dispatcher.predicted_ttft(new) == pytest.approx(3 * 2.0 + 0.11)
    # The worker reports having received a, with nothing waiting (a's backlog is its to report,
    # none here): room again, so b and c count as prefill ahead, a no more (1500 tokens: 2 steps).
    worker.take_report(msgspec.structs.replace(worker.capacity, num_received=1))
    assert dispatcher.predicted_ttft(new) == pytest.approx(0.17)


def test_the_dispatcher_measures_the_pace_of_room_as_it_sends() -> None:
    dispatcher = Dispatcher(Settings(dispatch=DispatchSettings(max_worker_waiting=1)), lambda job, final: None)
    worker = RecordingLink()
    dispatcher.attach(worker)
    for rid in ("a", "b", "c"):
        dispatcher.enqueue(job(rid))
    dispatcher.dispatch_ready()  # a goes out, b and c stay held: a gap starts
    assert dispatcher.pace.seconds_per_job("m") is None
    worker.capacity = msgspec.structs.replace(worker.capacity, num_received=1)  # the worker took a
    assert dispatcher.dispatch_ready() == 1  # b: the gap ends
    gap = dispatcher.pace.seconds_per_job("m")
    assert gap is not None and gap >= 0.0


@pytest.mark.parametrize("priority_enabled", [True, False])
def test_an_urgent_request_that_may_overtake_held_work_waits_for_no_room(priority_enabled: bool) -> None:
    from sluice.settings import SchedulerSettings

    dispatcher = Dispatcher(Settings(dispatch=DispatchSettings(max_worker_waiting=1),
                                     scheduler=SchedulerSettings(priority_enabled=priority_enabled)),
                            lambda job, final: None)
    dispatcher.attach(RecordingLink())
    for rid in ("a", "b"):
        dispatcher.enqueue(job(rid))
    dispatcher.dispatch_ready()  # a (standard) unstarted on the worker, b held
    dispatcher.pace = RoomPace()
    dispatcher.pace.sent("m", 0.0, left_held=True)
    dispatcher.pace.sent("m", 2.0, left_held=True)
    urgent = msgspec.structs.replace(job("new").request, priority=Priority.INTERACTIVE)
    if priority_enabled:
        # The room rule lets it overtake the unstarted standard job: no wait for room, nothing ahead.
        assert dispatcher.predicted_ttft(urgent) == pytest.approx(0.06)
    else:
        # One class: the worker's queue is full, so it waits behind b like any job, and a, sent as
        # standard and not reported yet, is ahead of it on the worker (1000 tokens: 10 + 100 ms).
        assert dispatcher.predicted_ttft(urgent) == pytest.approx(2 * 2.0 + 0.11)
