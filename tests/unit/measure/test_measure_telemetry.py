"""The per-request record and the Prometheus metrics agree; names, buckets and labels as specified."""

from __future__ import annotations

import json
import logging
import random

import msgspec
import numpy as np
import pytest

from sluice import telemetry
from sluice.metric_labels import BoundedLabel
from sluice.protocol import FinishReason, WorkerCapacity
from sluice.telemetry import RequestRecord, make_record
from sluice.workers.engine import GenerationResult

pytestmark = pytest.mark.unit


def _sample_value(name: str, labels: dict[str, str]) -> float:
    value = telemetry.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _record(request_id: str = "req-1", **changes: object) -> RequestRecord:
    args: dict[str, object] = dict(
        request_id=request_id, tenant="tenant-a", model="model-x", priority_class="interactive",
        worker="w0", arrival=100.0, dispatch_time=100.25, first_token_time=101.0, finish_time=102.0,
        token_times=[101.0, 101.1, 101.3, 101.6, 102.0], prompt_tokens=40, completion_tokens=5,
        cached_tokens=16, finish_reason="length", engine_first_scheduled=100.3,
        engine_first_token=100.9)
    args.update(changes)
    return make_record(**args)


def test_record_fields_are_computed_from_timestamps() -> None:
    record = _record()
    assert record.ttft_s == pytest.approx(1.0)
    assert record.queue_wait_s == pytest.approx(0.25)
    assert record.e2e_s == pytest.approx(2.0)
    gaps = [0.1, 0.2, 0.3, 0.4]
    assert record.itl_mean_s == pytest.approx(np.mean(gaps))
    assert record.itl_p50_s == pytest.approx(np.percentile(gaps, 50))
    assert record.itl_p95_s == pytest.approx(np.percentile(gaps, 95))
    assert record.itl_max_s == pytest.approx(0.4)
    assert record.engine_ttft_s == pytest.approx(100.9 - 100.25)  # from dispatch: worker's view
    assert record.prefill_s == pytest.approx(0.6)
    assert record.decode_s == pytest.approx(1.0)


def test_record_schema_is_complete_and_carries_no_content_or_secrets() -> None:
    required = {"request_id", "tenant", "model", "priority_class", "worker", "arrival", "queue_wait_s",
                "dispatch_time", "first_token_time", "finish_time", "prompt_tokens", "completion_tokens",
                "cached_tokens", "ttft_s", "itl_mean_s", "itl_p50_s", "itl_p95_s", "itl_max_s", "e2e_s",
                "finish_reason", "engine_ttft_s"}
    fields = set(RequestRecord.__struct_fields__)
    assert required <= fields
    forbidden = ("key", "text", "secret", "token_ids", "messages")
    assert not {f for f in fields if any(word in f for word in forbidden)}


def test_record_without_first_token_has_no_ttft_and_no_itl() -> None:
    record = _record(first_token_time=None, token_times=[], completion_tokens=0, finish_reason="abort",
                     engine_first_token=None)
    assert record.ttft_s is None and record.itl_p95_s is None and record.engine_ttft_s is None
    assert record.e2e_s == pytest.approx(2.0)


def test_finish_before_arrival_is_refused() -> None:
    with pytest.raises(ValueError, match="precedes arrival"):
        _record(finish_time=99.0)


def test_emit_writes_jsonl_and_logger_and_observes_the_same_ttft(tmp_path, caplog) -> None:
    path = tmp_path / "records.jsonl"
    telemetry.configure(str(path))
    labels = {"model": "model-emit", "class": "interactive", "tenant": "tenant-a"}
    before_sum = _sample_value("sluice:time_to_first_token_seconds_sum", labels)
    before_count = _sample_value("sluice:time_to_first_token_seconds_count", labels)
    record = _record("req-emit", model="model-emit")
    try:
        # with a record file the logger gets the record at DEBUG (off the terminal on `make run`)
        with caplog.at_level(logging.DEBUG, logger=telemetry.RECORDS_LOGGER):
            telemetry.emit_record(record, [101.0, 101.1, 101.3, 101.6, 102.0])
    finally:
        telemetry.configure("")
    [line] = path.read_bytes().splitlines()
    assert json.loads(line)["request_id"] == "req-emit"
    assert telemetry.read_records(path) == [record]
    assert any(json.loads(r.getMessage())["request_id"] == "req-emit" for r in caplog.records)
    # The histogram saw exactly this request's TTFT: the record and the metric agree.
    assert _sample_value("sluice:time_to_first_token_seconds_sum", labels) - before_sum == pytest.approx(
        record.ttft_s)
    assert _sample_value("sluice:time_to_first_token_seconds_count", labels) - before_count == 1
    # ITL histogram: one observation per real gap (4 gaps), summing to first->last token.
    assert _sample_value("sluice:inter_token_latency_seconds_count", labels) == 4
    assert _sample_value("sluice:inter_token_latency_seconds_sum", labels) == pytest.approx(1.0)
    assert _sample_value("sluice:prompt_tokens_total", {"model": "model-emit", "tenant": "tenant-a"}) == 40
    assert _sample_value("sluice:generation_tokens_total", {"model": "model-emit", "tenant": "tenant-a"}) == 5


def test_metric_names_and_buckets_as_specified() -> None:
    names = telemetry.metric_names()
    for name in ("sluice:time_to_first_token_seconds_bucket", "sluice:inter_token_latency_seconds_bucket",
                 "sluice:e2e_request_latency_seconds_bucket", "sluice:request_queue_time_seconds_bucket",
                 "sluice:request_prefill_time_seconds_bucket", "sluice:request_decode_time_seconds_bucket",
                 "sluice:num_requests_waiting", "sluice:num_requests_running", "sluice:kv_cache_usage_perc",
                 "sluice:prefix_cache_hit_rate", "sluice:prompt_tokens_total",
                 "sluice:generation_tokens_total", "sluice:request_rejections_total",
                 "sluice:num_preemptions_total", "sluice:spec_decode_num_draft_tokens_total",
                 "sluice:spec_decode_num_accepted_tokens_total"):
        assert name in names, name
    assert 3.0 in telemetry.TTFT_BUCKETS
    assert 0.3 in telemetry.ITL_BUCKETS
    body, content_type = telemetry.metrics_payload()
    assert content_type.startswith("text/plain")
    assert b"# TYPE sluice:time_to_first_token_seconds histogram" in body


def test_gauges_and_counters_follow_their_inputs() -> None:
    telemetry.set_queue_depth("batch", 7)
    telemetry.set_running("interactive", 3)
    first = WorkerCapacity(worker_id="w-gauge", num_running=2, num_waiting=1, free_kv_blocks=25,
                           total_kv_blocks=100, max_num_seqs=8, sent_at=0.0, num_preemptions=1)
    telemetry.observe_worker(first)
    telemetry.count_rejection("tenant-rej", "rpm")
    later = msgspec.structs.replace(first, num_preemptions=3, num_draft_tokens=10, num_accepted_draft_tokens=7)
    telemetry.count_engine_events(first, later)
    assert _sample_value("sluice:num_requests_waiting", {"class": "batch"}) == 7
    assert _sample_value("sluice:num_requests_running", {"class": "interactive"}) == 3
    assert _sample_value("sluice:kv_cache_usage_perc", {"worker": "w-gauge"}) == pytest.approx(0.75)
    assert _sample_value("sluice:request_rejections_total", {"tenant": "tenant-rej", "class": "other",
                                                             "reason": "rpm"}) == 1
    assert _sample_value("sluice:num_preemptions_total", {"worker": "w-gauge"}) == 2
    assert _sample_value("sluice:spec_decode_num_draft_tokens_total", {"worker": "w-gauge"}) == 10
    assert _sample_value("sluice:spec_decode_num_accepted_tokens_total", {"worker": "w-gauge"}) == 7
    # A restarted worker's counts start again from 0: nothing is counted, nothing goes negative.
    telemetry.count_engine_events(later, first)
    assert _sample_value("sluice:num_preemptions_total", {"worker": "w-gauge"}) == 2


def test_prefix_hit_rate_is_cached_over_prompt_tokens() -> None:
    telemetry.observe_record(_record("p1", worker="w-prefix", prompt_tokens=100, cached_tokens=50))
    telemetry.observe_record(_record("p2", worker="w-prefix", prompt_tokens=100, cached_tokens=0))
    assert _sample_value("sluice:prefix_cache_hit_rate", {"worker": "w-prefix"}) == pytest.approx(0.25)


def test_tenant_label_cardinality_is_capped() -> None:
    label = BoundedLabel(3)
    assert [label(f"t{i}") for i in range(5)] == ["t0", "t1", "t2", "other", "other"]
    assert label("t1") == "t1"  # known values keep their label


def test_tenant_queue_gauges_count_per_tenant_and_class_and_keep_emptied_tenants_at_zero() -> None:
    telemetry.set_tenant_queues([("tq-a", "batch"), ("tq-a", "batch"), ("tq-b", "interactive")],
                                [("tq-a", "standard")])
    waiting, running = "sluice:tenant_num_requests_waiting", "sluice:tenant_num_requests_running"
    assert _sample_value(waiting, {"tenant": "tq-a", "class": "batch"}) == 2
    assert _sample_value(waiting, {"tenant": "tq-b", "class": "interactive"}) == 1
    assert _sample_value(running, {"tenant": "tq-a", "class": "standard"}) == 1
    telemetry.set_tenant_queues([], [])
    assert telemetry.REGISTRY.get_sample_value(waiting, {"tenant": "tq-a", "class": "batch"}) == 0
    assert telemetry.REGISTRY.get_sample_value(running, {"tenant": "tq-a", "class": "standard"}) == 0


def test_the_tenant_cap_is_a_setting_and_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        telemetry.configure("", max_tenant_labels=0)


def test_percentile_matches_numpy() -> None:
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        values = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 95, 99, 100):
            assert telemetry.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert telemetry.percentile([], 50) is None
    with pytest.raises(ValueError):
        telemetry.percentile([1.0], 101)


def test_records_from_engine_results_use_the_same_schema() -> None:
    result = GenerationResult("g1", [1, 2, 3], token_ids=[7, 8, 9], finish_reason=FinishReason.LENGTH,
                              num_cached_tokens=0, arrival_time=10.0, first_scheduled_time=10.1,
                              first_token_time=10.5, finished_time=11.0, token_times=[10.5, 10.7, 11.0])
    [record] = telemetry.records_from_results([result], tenant="t", model="demo", classes={"g1": "batch"})
    assert record.ttft_s == pytest.approx(0.5) and record.engine_ttft_s == pytest.approx(0.5)
    assert record.priority_class == "batch" and record.finish_reason == "length"
    assert record.completion_tokens == 3 and record.prompt_tokens == 3
    assert msgspec.json.decode(telemetry.encode_record(record), type=RequestRecord) == record


def test_worker_ttft_falls_back_to_first_scheduling_without_dispatch() -> None:
    record = _record(dispatch_time=None)
    assert record.queue_wait_s is None
    assert record.engine_ttft_s == pytest.approx(100.9 - 100.3)
    assert record.engine_first_token == 100.9 and record.engine_first_scheduled == 100.3


def test_slo_attainment_is_judged_per_record_and_counted_per_class_and_tenant() -> None:
    """TTFT 1.0 s and token gaps 0.1..0.4 s (p95 ~0.385 s): met against 3 s / 0.5 s, missed against
    0.5 s TTFT or a 0.3 s ITL; no target or an abort is not judged, an error misses."""
    assert _record().slo_met is None
    assert _record(ttft_target_s=3.0, itl_target_s=0.5).slo_met is True
    assert _record(ttft_target_s=0.5, itl_target_s=0.5).slo_met is False
    assert _record(ttft_target_s=3.0, itl_target_s=0.3).slo_met is False
    assert _record(ttft_target_s=3.0, finish_reason="abort").slo_met is None
    assert _record(ttft_target_s=3.0, finish_reason="error").slo_met is False
    labels = {"model": "model-slo", "class": "interactive", "tenant": "tenant-slo"}
    for met, targets in ((True, (3.0, 0.5)), (True, (3.0, None)), (False, (0.5, 0.5)), (None, (None, None))):
        record = _record(model="model-slo", tenant="tenant-slo", ttft_target_s=targets[0], itl_target_s=targets[1])
        assert record.slo_met is met
        telemetry.observe_record(record)
    assert _sample_value("sluice:slo_requests_total", {**labels, "outcome": "met"}) == 2
    assert _sample_value("sluice:slo_requests_total", {**labels, "outcome": "missed"}) == 1
    assert msgspec.json.decode(telemetry.encode_record(_record(ttft_target_s=3.0)))["ttft_target_s"] == 3.0
