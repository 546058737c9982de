"""The side-by-side bench's verdict against the #17 targets, from hand-made summaries."""

from __future__ import annotations

from typing import Any

from sluice_lab.experiments.upstream_overhead import verdict


def column(saturated_rps: float | None, rps: dict[str, float], delta_p50: float = 0.0,
           delta_p99: float = 0.0) -> dict[str, Any]:
    return {"saturated_rps": saturated_rps,
            "levels": {level: {"rps": r, "delta_ttft_p50_s": delta_p50, "delta_ttft_p99_s": delta_p99}
                       for level, r in rps.items()}}


def test_targets_and_ratios() -> None:
    out = verdict({"sluice": column(100.0, {"1": 2.0, "200": 90.0}, delta_p50=0.002, delta_p99=0.02),
                   "litellm": column(8.0, {"1": 1.0, "200": 3.0})})
    assert out["delta_ttft_p50_at_1_met"] and not out["delta_ttft_p99_at_200_met"]
    assert out["rps_ratio_sluice_over_litellm"] == 12.5 and out["rps_ratio_met"]
    assert out["closed_loop_rps_ratio_by_level"] == {"1": 2.0, "200": 30.0}


def test_a_peer_that_finished_nothing_in_the_window_is_said_so() -> None:
    out = verdict({"sluice": column(40.0, {"1": 1.5}), "litellm": column(None, {"1": 1.0})})
    assert out["rps_ratio_met"] and "rps_ratio_sluice_over_litellm" not in out
    assert "finished no request" in out["rps_ratio_note"]


def test_without_litellm_there_is_no_ratio() -> None:
    out = verdict({"sluice": column(40.0, {"1": 1.5})})
    assert "rps_ratio_met" not in out and "closed_loop_rps_ratio_by_level" not in out
