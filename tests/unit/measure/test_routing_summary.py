"""`sluice bench routing`'s summary: the arrivals' figures and the backlogged phase's Jain index are
computed from their own requests (hand-made turns; the bench itself runs real workers)."""

from __future__ import annotations

import pytest

from sluice_lab.experiments.routing import Arm, Turn, jain, summarise


def _turn(phase: str, tenant: str, finish: float, *, worker: str = "w0", prompt: int = 100,
          cached: int = 0) -> Turn:
    return Turn(phase=phase, tenant=tenant, hot=tenant == "hot", conversation=0, arrival=finish - 1.0,
                prompt_tokens=prompt, first_token=finish - 0.5, finish=finish, output_tokens=10,
                cached_tokens=cached, worker=worker, route="cache")


def test_the_backlogged_phase_counts_what_ended_inside_its_window() -> None:
    arm = Arm("cache_aware", 0, backlog_window=(100.0, 160.0), worker_cpu_s={"w0": 30.0, "w1": 10.0})
    arm.turns = [
        _turn("arrivals", "a", 50.0, worker="w0", cached=90),
        _turn("arrivals", "b", 55.0, worker="w1"),
        _turn("backlog", "a", 120.0), _turn("backlog", "a", 150.0),
        _turn("backlog", "b", 130.0), _turn("backlog", "b", 170.0),  # after the window: not counted
        _turn("backlog", "c", 200.0),  # nothing inside the window: served 0
    ]
    arm.offered = {"a": 10, "b": 10}
    row = summarise([arm], ["w0", "w1"])["cache_aware"]
    assert row["requests"] == 2  # the arrivals only
    assert row["output_tokens_per_s"] == pytest.approx(20 / 6.0)  # arrival 49 to finish 55, not the backlog's
    assert row["prefill_tokens_saved"] == 90
    assert row["backlog_service_by_tenant"] == {"a": 220, "b": 110, "c": 0}
    assert row["jain_backlogged"] == pytest.approx(jain([220, 110, 0]))
    assert row["backlog_output_tokens_per_s"] == pytest.approx(30 / 60.0)  # three ended inside 100-160 s
    assert row["worker_cpu_share"] == {"w0": 0.75, "w1": 0.25}
    assert row["max_cpu_share_over_even"] == pytest.approx(1.5)
    assert row["worker_share"] == {"w0": round(20 / 130, 4), "w1": round(110 / 130, 4)}


def test_pro_rata_counts_the_output_decoded_inside_the_window() -> None:
    """A request decoding across the window's end is credited its prompt (first token inside) and
    half its output (half its decode inside), where whole-request counting credits it nothing; one
    decoding across the window's start, half its output, where whole-request counting credits it
    all (it ended inside)."""
    arm = Arm("cache_aware", 0, backlog_window=(100.0, 160.0))
    arm.turns = [_turn("backlog", "a", 120.0), _turn("backlog", "b", 160.25),  # decoding 159.75-160.25
                 _turn("backlog", "c", 100.25)]  # first token before the window: half its output
    row = summarise([arm], ["w0"])["cache_aware"]
    assert row["backlog_service_by_tenant"] == {"a": 110, "b": 0, "c": 110}
    assert row["backlog_service_pro_rata_by_tenant"] == {"a": 110, "b": 105, "c": 5}
    assert row["jain_backlogged_pro_rata"] == pytest.approx(jain([110, 105, 5]))
    assert row["backlog_output_tokens_per_s_pro_rata"] == pytest.approx(20 / 60.0)


def test_jain_is_one_for_equal_service_and_none_without_any() -> None:
    assert jain([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0]) == pytest.approx(0.5)
    assert jain([]) is None and jain([0.0, 0.0]) is None


def test_cache_aware_is_compared_with_least_loaded_over_the_arrivals_and_the_backlog() -> None:
    arms = []
    for policy, ttft, backlog_tokens in (("least_loaded", 1.0, 1), ("cache_aware", 0.25, 2)):
        arm = Arm(policy, 0, backlog_window=(100.0, 110.0))
        arrival = _turn("arrivals", "a", 50.0)
        arrival.first_token = arrival.arrival + ttft
        arm.turns = [arrival] + [_turn("backlog", "a", 101.0 + i) for i in range(backlog_tokens)]
        arm.offered = {"a": 10}
        arms.append(arm)
    versus = summarise(arms, ["w0"])["cache_aware_vs_least_loaded"]
    assert versus["ttft_p50_ratio"] == pytest.approx(4.0)  # lower is better: least_loaded / cache_aware
    assert versus["throughput_ratio"] == pytest.approx(1.0)
    assert versus["backlog_throughput_ratio"] == pytest.approx(2.0)  # higher is better: cache_aware / least_loaded
