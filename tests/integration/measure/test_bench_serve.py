"""`sluice bench serve` against a second, independent OpenAI-compatible server over real HTTP.

The server (hf_openai_server.py) shares no code with sluice, so a passing run shows the load
generator is not tied to sluice. The report's percentiles are checked against a direct numpy
computation on the per-request data the same run recorded.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCENARIO = """
name = "indep"
model = "demo"
endpoint = "{endpoint}"
duration_s = 2.0
max_requests = {max_requests}
seed = 7
[slo]
ttft_s = 30.0
itl_s = 5.0
[[tenants]]
name = "alpha"
api_key = "{key}"
[[tenants]]
name = "beta"
api_key = "{key}"
[[workloads]]
name = "chat"
tenant = "alpha"
service_tier = "priority"
arrival = {{ process = "poisson", rate = 3.0 }}
bursts = [{{ at_s = 0.5, count = 2 }}]
prompt_tokens = {{ dist = "uniform", min = 10, max = 40 }}
output_tokens = {{ dist = "fixed", value = 6 }}
[[workloads]]
name = "agent"
tenant = "beta"
arrival = {{ process = "closed", concurrency = 2 }}
prompt_tokens = {{ dist = "lognormal", median = 20, sigma = 0.5, min = 5, max = 60 }}
output_tokens = {{ dist = "uniform", min = 3, max = 8 }}
"""


def _bench(base_url: str, scenario: Path, out: Path, tokenizer: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", "bench", "serve", "--base-url", base_url, "--scenario",
         str(scenario), "--json", str(out), "--plot", str(out.with_suffix(".png")), "--tokenizer",
         str(tokenizer), "--no-progress"],
        capture_output=True, text=True, timeout=240)


def _check_percentiles(summary: dict, rows: list[dict]) -> None:
    ok = [r for r in rows if not r["error"]]
    ttfts = [r["ttft_s"] for r in ok]
    gaps = [b - a for r in ok for a, b in itertools.pairwise(r["token_times"])]
    e2es = [r["e2e_s"] for r in ok]
    for q in (50, 95, 99):
        assert summary[f"ttft_s_p{q}"] == pytest.approx(np.percentile(ttfts, q))
        assert summary[f"itl_s_p{q}"] == pytest.approx(np.percentile(gaps, q))
        assert summary[f"e2e_s_p{q}"] == pytest.approx(np.percentile(e2es, q))
    assert summary["max_itl_s"] == pytest.approx(max(gaps))
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in ok)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bench_serve_against_an_independent_server(hf_server_url: str, demo_model_dir: Path,
                                                   tmp_path: Path, endpoint: str) -> None:
    scenario = tmp_path / "indep.toml"
    scenario.write_text(SCENARIO.format(endpoint=endpoint, max_requests=8, key="test-key"), encoding="utf-8")
    out = tmp_path / "report.json"
    proc = _bench(hf_server_url, scenario, out, demo_model_dir)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    rows = report["requests"]
    assert report["summary"]["errors"] == {}
    # The open-loop arrivals are seeded; the closed-loop users issue what the server's speed allows
    # within duration_s (a loaded machine: fewer), never past max_requests.
    assert report["summary"]["succeeded"] == len(rows) <= 8
    assert {r["tenant"] for r in rows} == {"alpha", "beta"}
    assert set(report["by_class"]) == {"priority", "default"}  # as echoed by the server
    for row in rows:  # ignore_eos + max_tokens fix output lengths; usage came from the server
        assert row["completion_tokens"] == len(row["token_times"])
        assert row["prompt_tokens"] > 0 and row["request_id"].startswith(("chatcmpl-", "cmpl-"))
    chat_rows = [r for r in rows if r["workload"] == "chat"]
    assert all(r["completion_tokens"] == 6 for r in chat_rows)
    _check_percentiles(report["summary"], rows)
    for cls, summary in report["by_class"].items():
        _check_percentiles(summary, [r for r in rows if r["priority_class"] == cls])
    assert report["summary"]["slo_attainment"] == 1.0  # generous SLO: every request is good
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "class priority" in proc.stdout


def test_bench_serve_reports_errors_by_type_and_fails_when_nothing_succeeds(
        hf_server_url: str, demo_model_dir: Path, tmp_path: Path) -> None:
    scenario = tmp_path / "badkey.toml"
    scenario.write_text(SCENARIO.format(endpoint="chat", max_requests=3, key="wrong-key"), encoding="utf-8")
    out = tmp_path / "report.json"
    proc = _bench(hf_server_url, scenario, out, demo_model_dir)
    assert proc.returncode == 1
    report = json.loads(out.read_text())
    assert report["summary"]["succeeded"] == 0
    assert report["summary"]["errors"] == {"http_401": report["summary"]["requests"]}
    assert "errors: http_401=" in proc.stdout


def test_bench_serve_rejects_a_broken_scenario_in_one_line(tmp_path: Path) -> None:
    scenario = tmp_path / "broken.toml"
    scenario.write_text("[[workloads]]\narrival = { process = \"poisson\", rate = -2 }\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "bench", "serve", "--base-url",
                           "http://127.0.0.1:9", "--scenario", str(scenario)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("sluice: error:") and "broken.toml" in proc.stderr


@pytest.mark.parametrize("value", ["-1", "101", "many"])
def test_bench_serve_rejects_a_bad_reconnects_count_in_one_line(tmp_path: Path, value: str) -> None:
    scenario = tmp_path / "ok.toml"
    scenario.write_text(SCENARIO.format(endpoint="chat", max_requests=1, key="k"), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "bench", "serve", "--base-url",
                           "http://127.0.0.1:9", "--scenario", str(scenario), "--reconnects", value],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]  # argparse's own type error has the usage above it
    assert last.startswith("sluice: error:") and "--reconnects" in last
