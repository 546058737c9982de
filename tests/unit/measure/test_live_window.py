"""The console's rolling window: buckets, per-minute rates, tokens/s, recent events, bounds."""

from __future__ import annotations

import pytest

from sluice.live_window import MAX_EVENTS, MAX_SAMPLES, LiveWindow

pytestmark = pytest.mark.unit


def test_series_buckets_ttft_itl_and_throughput() -> None:
    window = LiveWindow(horizon_s=60, bucket_s=10)
    for i in range(20):  # TTFT 0.01..0.20 s, token gaps of 0.05 s, 10 tokens each, in one bucket
        window.observe_request("alice", ttft_s=0.01 * (i + 1), token_times=[1.0, 1.05, 1.10],
                               completion_tokens=10, finish_reason="stop", now=105.0)
    points = window.series("alice", now=119.0)
    assert len(points) == 6 and points[-1].start == 110.0
    full = points[-2]
    assert full.start == 100.0
    assert full.ttft_p95_s == pytest.approx(0.1905)
    assert full.itl_p95_s == pytest.approx(0.05)
    assert full.tokens_per_s == pytest.approx(200 / 10)
    assert points[-1].ttft_p95_s is None and points[-1].tokens_per_s == 0.0
    assert window.series("alice", now=200.0)[-2].ttft_p95_s is None  # out of the horizon
    assert window.tenants(now=200.0) == []


def test_per_minute_counts_expire_after_a_minute() -> None:
    window = LiveWindow()
    for t in (0.0, 30.0, 59.0):
        window.count_admission("alice", "interactive", now=t)
    window.count_rejection("bob", "rate_limit_exceeded", "standard", now=59.0)
    assert window.per_minute("admitted", "alice", now=59.5) == 3
    assert window.per_minute("admitted_class", "interactive", now=59.5) == 3
    assert window.per_minute("admitted", "alice", now=80.0) == 2
    assert window.per_minute("rejected", "bob", now=80.0) == 1
    assert window.per_minute("rejected_class", "standard", now=80.0) == 1
    assert window.per_minute("rejected", "alice", now=80.0) == 0
    assert window.tenants(now=80.0) == ["alice", "bob"]


def test_worker_tokens_per_second_over_ten_seconds() -> None:
    window = LiveWindow()
    for t in range(10):
        window.count_worker_tokens("w1", 50, now=float(t))
    assert window.tokens_per_s("w1", now=9.5) == pytest.approx(50.0)
    assert window.tokens_per_s("w1", now=30.0) == 0.0
    assert window.tokens_per_s("nobody") == 0.0


def test_recent_events_newest_first_and_bounded() -> None:
    window = LiveWindow()
    window.observe_request("alice", ttft_s=None, token_times=[], completion_tokens=0, finish_reason="error",
                           now=1.0)
    for i in range(MAX_EVENTS + 5):
        window.count_rejection("bob", "rate_limit_exceeded", now=2.0 + i)
    events = window.recent_events(limit=1000)
    assert len(events) == MAX_EVENTS
    assert events[0].tenant == "bob" and events[0].at == 2.0 + MAX_EVENTS + 4
    assert all(e.kind == "rejected" for e in events)  # the old error fell off the end


def test_samples_per_bucket_are_bounded() -> None:
    window = LiveWindow(horizon_s=10, bucket_s=10)
    for i in range(5 * MAX_SAMPLES):
        window.observe_request("alice", ttft_s=float(i), token_times=[], completion_tokens=1,
                               finish_reason="stop", now=1.0)
    bucket = window._series["alice"][0]
    assert len(bucket.ttft) == MAX_SAMPLES and bucket.ttft_seen == 5 * MAX_SAMPLES
    assert bucket.requests == 5 * MAX_SAMPLES  # counts stay exact, only the samples are capped


def test_bad_window_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="bucket_s"):
        LiveWindow(horizon_s=5, bucket_s=10)


def test_objective_outcomes_per_class_and_tenant() -> None:
    """Attainment, the loosest target seen (a header only tightens) and the p95s, within the horizon."""
    window = LiveWindow(horizon_s=60, bucket_s=10)
    for i in range(20):  # 19 of 20 met; TTFT 0.1..2.0 s; one request tightened its TTFT target to 1 s
        window.observe_slo("interactive", "alice", met=i != 19, ttft_s=0.1 * (i + 1), itl_p95_s=0.05,
                           ttft_target_s=1.0 if i == 0 else 3.0, itl_target_s=0.3, now=10.0 + i)
    window.observe_slo("standard", "alice", met=False, ttft_s=None, itl_p95_s=None, ttft_target_s=10.0,
                       itl_target_s=None, now=5.0)
    interactive, standard = window.slo_summaries(now=40.0)
    assert (interactive.priority_class, interactive.tenant, interactive.requests, interactive.met) == (
        "interactive", "alice", 20, 19)
    assert interactive.attained == pytest.approx(0.95)
    assert (interactive.ttft_target_s, interactive.itl_target_s) == (3.0, 0.3)
    assert interactive.ttft_p95_s == pytest.approx(1.905) and interactive.itl_p95_s == pytest.approx(0.05)
    assert standard.attained == 0.0 and standard.ttft_p95_s is None and standard.itl_target_s is None
    assert [s.priority_class for s in window.slo_summaries(now=66.0)] == ["interactive"]  # standard aged out
    assert window.slo_summaries(now=200.0) == []
