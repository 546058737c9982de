"""The load generator and the stack-level experiments against sluice itself (`sluice serve`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.telemetry import read_records
from sluice_lab.experiments.gateway_overhead import measure_overhead, plot_overhead
from sluice_lab.experiments.stack import Stack, start_stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFIG = Path(__file__).resolve().parents[3] / "config"

SCENARIO = """
name = "sluice-smoke"
model = "{model}"
duration_s = 2.0
max_requests = 6
[[tenants]]
name = "chat"
api_key = "{chat_key}"
[[tenants]]
name = "nightly"
api_key = "{batch_key}"
[[workloads]]
name = "chat"
tenant = "chat"
service_tier = "priority"
arrival = {{ process = "poisson", rate = 4.0 }}
prompt_tokens = {{ dist = "uniform", min = 8, max = 32 }}
output_tokens = {{ dist = "fixed", value = 5 }}
[[workloads]]
name = "translation"
tenant = "nightly"
api = "batch"
batch_lines = 3
batch_poll_s = 0.5
prompt_tokens = {{ dist = "fixed", value = 16 }}
output_tokens = {{ dist = "fixed", value = 4 }}
"""


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "bench", *args],
                          capture_output=True, text=True, timeout=840)


@pytest.fixture(scope="module")
def stack(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(CONFIG, tmp_path_factory.mktemp("stack"), demo_model_dir) as running:
        yield running


def test_bench_serve_against_sluice(stack: Stack, demo_model_dir: Path, tmp_path: Path) -> None:
    chat_key = stack.create_tenant_key("chat", ceiling="interactive", default_class="interactive")
    batch_key = stack.create_tenant_key("nightly", ceiling="batch", default_class="batch")
    scenario = tmp_path / "smoke.toml"
    scenario.write_text(SCENARIO.format(model=stack.model, chat_key=chat_key, batch_key=batch_key))
    out = tmp_path / "report.json"
    proc = _bench("serve", "--base-url", stack.base_url, "--scenario", str(scenario), "--json", str(out),
                  "--tokenizer", str(demo_model_dir), "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    time.sleep(0.5)  # the gateway writes a record just after its stream ends
    records = {r.request_id: r for r in read_records(stack.record_log)}
    assert report["summary"]["errors"] == {}
    assert report["summary"]["succeeded"] == 6
    assert set(report["by_class"]) == {"priority"}
    [batch] = report["batches"]
    assert batch["status"] == "completed" and batch["completed"] == 3 and batch["completion_s"] > 0
    for row in report["requests"]:
        assert row["completion_tokens"] == 5
        record = records[row["request_id"]]  # the response id joins client and gateway records
        assert record.tenant == "chat" and record.priority_class == "interactive"
        assert record.engine_ttft_s is not None
        assert record.ttft_s <= row["ttft_s"]  # the gateway sees the first token before the client


def test_gateway_overhead_measurement(stack: Stack, tmp_path: Path) -> None:
    summary = measure_overhead(stack, [4], 8, kafka_messages=20)
    [level] = summary["levels"]
    assert level["errors"] == 0 and level["joined"] == level["requests"] == 8
    for key in ("overhead_p50_s", "overhead_p99_s", "client_ttft_p50_s", "worker_ttft_p50_s",
                "admission_p50_s"):
        assert level[key] is not None, key
    assert level["overhead_p50_s"] > 0  # the client always sees the token after the worker made it
    assert summary["kafka"]["produce_ack_p50_s"] > 0
    assert set(summary["headline"]) >= {"overhead_p50_s", "overhead_p99_s"}
    plot_overhead(summary, tmp_path / "overhead.png")
    assert (tmp_path / "overhead.png").stat().st_size > 10_000


@pytest.mark.timeout(900)  # two arms of a real stack each; 280 s ran out on a loaded machine
def test_isolation_quick(demo_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "isolation.json"
    proc = _bench("isolation", "--quick", "--flood", "20", "--model", str(demo_model_dir), "--config-dir",
                  str(CONFIG), "--json", str(out), "--plot", str(tmp_path / "isolation.png"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    ratios = summary["interactive_ttft_p95_ratio_flood_over_baseline"]
    assert set(ratios) == {"priority_on", "priority_off"}
    assert all(v is not None and v > 0 for v in ratios.values())
    for arm in summary["arms"].values():
        assert arm["baseline"]["errors"] == arm["flood"]["errors"] == 0
        assert arm["flood_batch"]["lines"] == 20
