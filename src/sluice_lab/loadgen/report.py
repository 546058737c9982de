"""Summaries of a load-generator run: percentiles, throughput and goodput per class and tenant.

Definitions (the same in every sluice report):
- TTFT and e2e percentiles are over requests (one value per successful request).
- ITL percentiles are over token gaps pooled across the group's requests (every gap between two
  consecutive streamed chunks counts once), as vLLM's benchmark does; `max_itl_s` is the worst
  single stall.
- Percentiles use `sluice.telemetry.percentile` (linear interpolation, numpy's default).
- Throughput divides by the run's wall time (first send to last reply).
- Each request is judged against its own objective: the targets sluice says it served it against
  (the answer's X-Sluice-Objective: class, tenant and request header resolved, docs/objectives.md),
  else, from a server that sends none, the scenario's SLO (`--slo`). A request whose objective has
  no target (batch) is not judged. It meets it when it succeeded, its TTFT <= the TTFT target and
  its own ITL p95 <= the ITL target (fewer than two tokens meet the ITL target trivially).
- Goodput: requests that met their objective per second of wall time; SLO attainment: those / the
  requests judged. A group's `ttft_target_s` / `itl_target_s` are the loosest its requests had
  (a request header only tightens, so that is the class's or tenant's objective).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from sluice.objectives import Objective
from sluice.telemetry import percentile
from sluice_lab.loadgen.client import ClientResult
from sluice_lab.loadgen.runner import RunResult
from sluice_lab.loadgen.scenario import Scenario, Slo

QUANTILES = (50, 95, 99)


def _pcts(values: Sequence[float], name: str) -> dict[str, float | None]:
    return {f"{name}_p{q}": percentile(values, q) for q in QUANTILES}


def request_gaps(result: ClientResult) -> list[float]:
    return [b - a for a, b in itertools.pairwise(result.token_times)]


def objective_of(result: ClientResult, slo: Slo) -> Objective:
    """The targets a request is judged against (module docstring)."""
    return result.objective if result.objective is not None else Objective(ttft_s=slo.ttft_s, itl_s=slo.itl_s)


def meets_slo(result: ClientResult, slo: Slo) -> bool | None:
    """Whether the request met its objective; None: it had none (not judged)."""
    objective = objective_of(result, slo)
    if objective.ttft_s is None and objective.itl_s is None:
        return None
    if not result.ok or result.first_token is None:
        return False
    return objective.met(result.first_token - result.sent, percentile(request_gaps(result), 95))


def _loosest(values: Iterable[float | None]) -> float | None:
    return max((v for v in values if v is not None), default=None)


def summarize(results: Sequence[ClientResult], wall_s: float, slo: Slo) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.first_token - r.sent for r in ok if r.first_token is not None]
    e2es = [r.finish - r.sent for r in ok]
    gaps = [g for r in ok for g in request_gaps(r)]
    judged = [m for m in (meets_slo(r, slo) for r in results) if m is not None]
    good = sum(judged)
    targets = [objective_of(r, slo) for r in results]
    out_tokens = sum(r.completion_tokens for r in ok)
    wall = max(wall_s, 1e-9)
    summary: dict[str, Any] = {
        "requests": len(results),
        "succeeded": len(ok),
        "errors": dict(Counter(r.error for r in results if r.error)),
        "reconnects": sum(r.reconnects for r in results),  # broken streams re-attached (--reconnects)
        **_pcts(ttfts, "ttft_s"),
        **_pcts(gaps, "itl_s"),
        **_pcts(e2es, "e2e_s"),
        "max_itl_s": max(gaps) if gaps else None,
        "request_throughput_rps": len(ok) / wall,
        "output_token_throughput_tps": out_tokens / wall,
        "input_token_throughput_tps": sum(r.prompt_tokens for r in ok) / wall,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "completion_tokens": out_tokens,
        "judged": len(judged),
        "goodput_rps": good / wall,
        "slo_attainment": good / len(judged) if judged else None,
        "ttft_target_s": _loosest(t.ttft_s for t in targets),
        "itl_target_s": _loosest(t.itl_s for t in targets),
        "ttft_prediction": ttft_prediction(ok),
    }
    return summary


def ttft_prediction(results: Sequence[ClientResult]) -> dict[str, Any]:
    """How far the gateway's TTFT prediction at admission was from the TTFT measured here, over the
    answers that carried one: |predicted - observed| / observed at the median and p95, and the
    median of predicted / observed (under 1: it predicted too soon)."""
    pairs = [(r.predicted_ttft_s, r.first_token - r.sent) for r in results
             if r.predicted_ttft_s is not None and r.first_token is not None and r.first_token > r.sent]
    errors = [abs(p - o) / o for p, o in pairs]
    return {"requests": len(pairs), "abs_error_rel_p50": percentile(errors, 50),
            "abs_error_rel_p95": percentile(errors, 95),
            "predicted_over_observed_p50": percentile([p / o for p, o in pairs], 50)}


def _class_of(result: ClientResult) -> str:
    return result.service_tier or result.spec.service_tier or "default"


def _grouped(results: Iterable[ClientResult], key) -> dict[str, list[ClientResult]]:
    groups: dict[str, list[ClientResult]] = defaultdict(list)
    for result in results:
        groups[key(result)].append(result)
    return dict(sorted(groups.items()))


def build_report(run: RunResult, scenario: Scenario, slo: Slo, seed: int) -> dict[str, Any]:
    results = sorted(run.results, key=lambda r: r.sent)
    report: dict[str, Any] = {
        "scenario": scenario.name,
        "base_url": run.base_url,
        "model": scenario.model,
        "seed": seed,
        "wall_s": run.wall_s,
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "percentile_method": "linear interpolation between closest ranks (numpy default)",
        "summary": summarize(results, run.wall_s, slo),
        "by_class": {k: summarize(v, run.wall_s, slo) for k, v in _grouped(results, _class_of).items()},
        "by_tenant": {k: summarize(v, run.wall_s, slo)
                      for k, v in _grouped(results, lambda r: r.spec.tenant).items()},
        "by_workload": {k: summarize(v, run.wall_s, slo)
                        for k, v in _grouped(results, lambda r: r.spec.workload).items()},
        "batches": [msgspec.to_builtins(b) for b in run.batches],
        "requests": [request_row(r, scenario.model, run.started) for r in results],
    }
    return report


def request_row(result: ClientResult, model: str, started: float) -> dict[str, Any]:
    """The per-request data behind every number: the telemetry record plus raw chunk times."""
    row = msgspec.to_builtins(result.to_record(model))
    row["workload"] = result.spec.workload
    row["error"] = result.error
    row["error_detail"] = result.error_detail
    row["reconnects"] = result.reconnects
    row["sent_offset_s"] = result.sent - started
    row["token_times"] = list(result.token_times)
    return row


def format_table(report: dict[str, Any]) -> str:
    """A compact text table: one row per class and per tenant, with its objective (targets in ms)
    and goodput against it ("good" is the SLO attainment)."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = [f"scenario {report['scenario']}: {report['summary']['requests']} requests in "
             f"{report['wall_s']:.1f} s against {report['base_url']}",
             f"{'group':<28}{'n':>6}{'err':>5}{'ttft p50/p95/p99 ms':>22}{'itl p50/p95/p99 ms':>21}"
             f"{'max itl':>9}{'tok/s':>9}{'target ttft/itl':>17}{'good':>7}{'goodput/s':>11}"]
    rows = [("all", report["summary"])]
    rows += [(f"class {k}", v) for k, v in report["by_class"].items()]
    rows += [(f"tenant {k}", v) for k, v in report["by_tenant"].items()]
    for name, s in rows:
        ttft = "/".join(ms(s[f"ttft_s_p{q}"]) for q in QUANTILES)
        itl = "/".join(ms(s[f"itl_s_p{q}"]) for q in QUANTILES)
        good = "-" if s["slo_attainment"] is None else f"{s['slo_attainment']:.0%}"
        target = f"{ms(s['ttft_target_s'])}/{ms(s['itl_target_s'])}"
        goodput = "-" if s["slo_attainment"] is None else f"{s['goodput_rps']:.2f}"
        lines.append(f"{name[:27]:<28}{s['requests']:>6}{sum(s['errors'].values()):>5}{ttft:>22}{itl:>21}"
                     f"{ms(s['max_itl_s']):>9}{s['output_token_throughput_tps']:>9.1f}{target:>17}{good:>7}"
                     f"{goodput:>11}")
    for batch in report["batches"]:
        done = "-" if batch["completion_s"] is None else f"{batch['completion_s']:.1f} s"
        lines.append(f"batch {batch['workload']}: {batch['status'] or 'not started'} {batch['completed']}/"
                     f"{batch['lines']} lines in {done}" + (f" ({batch['error']})" if batch["error"] else ""))
    predicted = report["summary"]["ttft_prediction"]
    if predicted["requests"]:
        lines.append(f"TTFT predicted at admission vs observed, {predicted['requests']} requests: |error| / observed "
                     f"p50 {predicted['abs_error_rel_p50']:.2f}, p95 {predicted['abs_error_rel_p95']:.2f}; "
                     f"predicted / observed p50 {predicted['predicted_over_observed_p50']:.2f}")
    errors = report["summary"]["errors"]
    if errors:
        lines.append("errors: " + ", ".join(f"{k}={v}" for k, v in sorted(errors.items())))
    return "\n".join(lines)
