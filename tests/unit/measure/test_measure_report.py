"""Report arithmetic on hand-made client results: goodput, grouping, error counts."""

from __future__ import annotations

import pytest

from sluice.objectives import format_header, parse_served
from sluice_lab.loadgen.client import ClientResult, RequestSpec
from sluice_lab.loadgen.report import meets_slo, summarize
from sluice_lab.loadgen.scenario import Slo

pytestmark = pytest.mark.unit


def _result(sent: float, token_times: list[float], error: str = "", tenant: str = "t") -> ClientResult:
    spec = RequestSpec(local_id="x", workload="w", tenant=tenant, api_key="sk-secret", prompt="p", max_tokens=4,
                       service_tier="priority", ignore_eos=True, temperature=0.0)
    return ClientResult(spec=spec, sent=sent, request_id=f"id-{sent}",
                        first_token=token_times[0] if token_times else None, token_times=token_times,
                        finish=(token_times or [sent])[-1], completion_tokens=len(token_times), error=error)


def test_goodput_counts_requests_meeting_both_slos() -> None:
    slo = Slo(ttft_s=1.0, itl_s=0.2)
    fast = _result(0.0, [0.5, 0.6, 0.7])
    slow_start = _result(0.0, [1.5, 1.6])
    stalling = _result(0.0, [0.1, 0.2, 1.2])  # one 1 s gap: its own ITL p95 is above 0.2 s
    single = _result(0.0, [0.3])  # one token: no gaps, meets the ITL SLO trivially
    failed = _result(0.0, [], error="http_429")
    assert [meets_slo(r, slo) for r in (fast, slow_start, stalling, single, failed)] == [
        True, False, False, True, False]
    summary = summarize([fast, slow_start, stalling, single, failed], wall_s=2.0, slo=slo)
    assert summary["goodput_rps"] == pytest.approx(1.0)
    assert summary["slo_attainment"] == pytest.approx(2 / 5)
    assert summary["errors"] == {"http_429": 1}
    assert summary["succeeded"] == 4
    assert summary["max_itl_s"] == pytest.approx(1.0)
    assert summary["output_token_throughput_tps"] == pytest.approx(9 / 2.0)


def test_the_record_of_a_client_result_carries_no_key_or_prompt() -> None:
    record = _result(0.0, [0.5, 0.6]).to_record("m")
    encoded = repr(record)
    assert "sk-secret" not in encoded and record.ttft_s == pytest.approx(0.5)


def test_each_request_is_judged_against_the_objective_it_was_served_against() -> None:
    """The answer's X-Sluice-Objective wins over the scenario's SLO; "none" (batch) is not judged;
    a server without the header falls back to the SLO. Targets per group: the loosest seen."""
    slo = Slo(ttft_s=1.0, itl_s=0.2)
    tight = _result(0.0, [0.5, 0.6, 0.7])  # TTFT 0.5 s: over its tightened 0.4 s target
    tight.objective = parse_served("ttft=0.4, itl=0.3")
    loose = _result(0.0, [1.5, 1.6])  # TTFT 1.5 s: within its class's 3 s
    loose.objective = parse_served(format_header(3.0, 0.3))
    batch = _result(0.0, [9.0, 9.5])
    batch.objective = parse_served("none")
    plain = _result(0.0, [0.5, 0.6])  # no header: the scenario's SLO
    assert [meets_slo(r, slo) for r in (tight, loose, batch, plain)] == [False, True, None, True]
    summary = summarize([tight, loose, batch, plain], wall_s=2.0, slo=slo)
    assert summary["judged"] == 3 and summary["slo_attainment"] == pytest.approx(2 / 3)
    assert summary["goodput_rps"] == pytest.approx(1.0)
    assert (summary["ttft_target_s"], summary["itl_target_s"]) == (3.0, 0.3)
    assert summarize([batch], wall_s=1.0, slo=slo)["slo_attainment"] is None
    assert parse_served(None) is None and parse_served("garbage") is None
    record = loose.to_record("m")
    assert (record.ttft_target_s, record.itl_target_s, record.slo_met) == (3.0, 0.3, True)


def test_the_gateways_ttft_prediction_is_set_beside_the_measured_ttft() -> None:
    """Predicted 0.5 s for a 1.0 s TTFT (error 0.5), 1.5 s for 1.0 s (0.5), 1.0 s for 2.0 s (0.5),
    2.0 s for 1.0 s (1.0); an answer without the header, and a failed one, are left out."""
    results = []
    for predicted, ttft in ((0.5, 1.0), (1.5, 1.0), (1.0, 2.0), (2.0, 1.0), (None, 1.0)):
        result = _result(0.0, [ttft, ttft + 0.1])
        result.predicted_ttft_s = predicted
        results.append(result)
    failed = _result(0.0, [], error="http_500")
    failed.predicted_ttft_s = 1.0
    summary = summarize([*results, failed], wall_s=1.0, slo=Slo(ttft_s=3.0, itl_s=1.0))["ttft_prediction"]
    assert summary["requests"] == 4
    assert summary["abs_error_rel_p50"] == pytest.approx(0.5)
    assert summary["predicted_over_observed_p50"] == pytest.approx(1.0)  # of 0.5, 0.5, 1.5, 2.0
    assert results[0].to_record("m").predicted_ttft_s == 0.5


@pytest.mark.parametrize("value, seconds", [("1234", 1.234), ("0", 0.0), (None, None), ("", None), ("soon", None),
                                            ("-5", None), ("nan", None), ("inf", None)])
def test_the_predicted_ttft_header_is_read_or_ignored(value: str | None, seconds: float | None) -> None:
    from sluice.objectives import format_predicted_ttft, parse_predicted_ttft

    assert parse_predicted_ttft(value) == (None if seconds is None else pytest.approx(seconds))
    assert parse_predicted_ttft(format_predicted_ttft(2.5)) == pytest.approx(2.5)
