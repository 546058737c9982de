"""The shipped Prometheus rules (deploy/prometheus/alerts.yml): valid (`promtool check rules`),
behaving as their unit tests say (`promtool test rules deploy/prometheus/alerts_test.yml`), and
written against metric names the gateway really exports.

promtool comes from Debian's `prometheus` package (.ci/run installs it under CI=true); without it
the promtool tests skip locally and fail in CI."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sluice import telemetry
from sluice.gateway.batches import window  # registers the batch window gauges

pytestmark = pytest.mark.unit

RULES_DIR = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"
RULES = RULES_DIR / "alerts.yml"
RULE_TESTS = RULES_DIR / "alerts_test.yml"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing: .ci/run installs Debian's prometheus package under CI=true")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120, cwd=RULES_DIR)


def test_promtool_check_rules_passes() -> None:
    result = _run("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests_pass() -> None:
    result = _run("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def _rules() -> list[dict[str, str]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_rules_use_only_metrics_the_gateway_exports() -> None:
    exported = telemetry.metric_names()
    assert window.BATCH_WINDOW is not None
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    for rule in _rules():
        for name in re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+", rule["expr"]):
            assert name in exported or name in recorded, f"{rule.get('alert') or rule['record']} uses {name}"


def test_every_alert_the_issue_asks_for_is_there_and_unit_tested() -> None:
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    assert alerts >= {"SluiceNoWorkers", "SluiceWorkerLost", "SluiceQueueGrowing", "SluiceTTFTBudgetFastBurn",
                      "SluiceITLBudgetFastBurn", "SluiceServerErrors", "SluiceKafkaUnreachable",
                      "SluiceRedisUnreachable", "SluiceBatchWindowAtRisk"}
    tested = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test.get("alert_rule_test", [])}
    assert alerts <= tested, f"alerts without a promtool unit test: {sorted(alerts - tested)}"
    for rule in _rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("critical", "warning", "info")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
