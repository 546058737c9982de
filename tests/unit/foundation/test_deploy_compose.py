"""The compose file is the documented production shape (docs/runbook.md "Start"), checked without a
Docker engine: docker-compose 1.29 (Debian's `docker-compose`, the oldest parser we promise;
.ci/run installs it under CI=true) validates it with `config`, and the shape is asserted here:
Kafka, PostgreSQL, Redis, two gateway replicas behind HAProxy checking /ready, a grace period above
the drain timeout, a worker linked to both replicas, Prometheus with the shipped rules, Grafana
with the dashboard."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sluice.settings import load_settings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
DOCKER = REPO / "docker"
COMPOSE_FILE = DOCKER / "docker-compose.yml"
COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text())
SERVICES = COMPOSE["services"]
GATEWAYS = ["gateway-1", "gateway-2"]
SECRETS = {"SLUICE_ADMIN_TOKEN": "a" * 32, "SLUICE_WORKER_SECRET": "w" * 32, "SLUICE_METRICS_TOKEN": "m" * 32}


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert match, duration
    return int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


def _compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("docker-compose")
    if tool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("docker-compose is missing: .ci/run installs Debian's docker-compose under CI=true")
        pytest.skip("docker-compose (1.29, Debian's package) is not installed")
    environ = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **(env or {})}
    return subprocess.run([tool, "-f", str(COMPOSE_FILE), *args], capture_output=True, text=True,
                          timeout=120, cwd=DOCKER, env=environ)


def test_docker_compose_1_29_accepts_the_file() -> None:
    result = _compose("config", "-q", env=SECRETS)
    assert result.returncode == 0, result.stderr


def test_docker_compose_refuses_to_start_without_the_secrets() -> None:
    result = _compose("config", "-q", env={k: v for k, v in SECRETS.items() if k != "SLUICE_METRICS_TOKEN"})
    assert result.returncode != 0 and "SLUICE_METRICS_TOKEN" in result.stderr


def test_no_top_level_name() -> None:
    assert "name" not in COMPOSE  # docker-compose 1.29 rejects it


def test_the_production_shape() -> None:
    assert set(SERVICES) >= {"kafka", "postgres", "redis", *GATEWAYS, "lb", "worker", "prometheus", "grafana"}
    assert "haproxy" in SERVICES["lb"]["image"]
    assert SERVICES["lb"]["ports"] == ["8000:8000"]  # clients reach the replicas through the balancer only
    assert all("ports" not in SERVICES[g] for g in GATEWAYS)
    assert SERVICES["gateway-2"]["depends_on"] == {"gateway-1": {"condition": "service_healthy"}}  # one migrates


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_replicas_share_state_and_outlive_their_drain(gateway: str) -> None:
    service = SERVICES[gateway]
    env = {k: re.sub(r"\$\{[^}]+\}", "x" * 32, str(v)) for k, v in service["environment"].items()}
    env.pop("SLUICE_CONFIG_DIR")
    settings = load_settings(REPO / "config", environ=env)
    assert settings.shared.url == "redis://redis:6379/0"
    assert _seconds(service["stop_grace_period"]) > settings.gateway.drain_timeout_s
    check = " ".join(service["healthcheck"]["test"])
    assert "/ready" in check


def test_the_balancer_checks_ready_on_every_replica() -> None:
    config = (DOCKER / "haproxy.cfg").read_text()
    assert re.search(r"option httpchk GET /ready\b", config)
    servers = re.findall(r"^\s*server\s+\S+\s+(\S+):8000\s+check", config, flags=re.MULTILINE)
    assert sorted(servers) == GATEWAYS
    mount = next(v for v in SERVICES["lb"]["volumes"] if "haproxy.cfg" in v)
    assert (DOCKER / mount.split(":")[0]).resolve() == DOCKER / "haproxy.cfg"


def test_the_worker_links_to_every_replica() -> None:
    command = SERVICES["worker"]["command"]
    listed = command[command.index("--gateway") + 1].split(",")
    assert sorted(listed) == [f"{g}:8100" for g in GATEWAYS]
    assert SERVICES["worker"]["stop_grace_period"]


def _mount_source(service: str, target: str) -> Path:
    for volume in SERVICES[service]["volumes"]:
        source, _, rest = volume.partition(":")
        if rest.split(":")[0] == target:
            return (DOCKER / source).resolve()
    raise AssertionError(f"{service} mounts nothing at {target}")


def test_prometheus_scrapes_the_replicas_with_the_token_and_loads_the_alert_rules() -> None:
    config = yaml.safe_load(_mount_source("prometheus", "/etc/prometheus/prometheus.yml").read_text())
    assert _mount_source("prometheus", "/etc/prometheus/alerts.yml") == REPO / "deploy" / "prometheus" / "alerts.yml"
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    [job] = config["scrape_configs"]
    assert job["job_name"] == "sluice-gateway"  # what the alert rules expect
    assert sorted(job["static_configs"][0]["targets"]) == [f"{g}:8000" for g in GATEWAYS]
    token_file = job["authorization"]["credentials_file"]
    assert token_file in " ".join(SERVICES["prometheus"]["entrypoint"])  # written from SLUICE_METRICS_TOKEN


def test_promtool_accepts_the_prometheus_config(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing under CI=true")
        pytest.skip("promtool is not installed")
    # The container's paths, here: the rules and a token file beside a copy of the config.
    text = _mount_source("prometheus", "/etc/prometheus/prometheus.yml").read_text()
    (tmp_path / "alerts.yml").write_text((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    (tmp_path / "metrics-token").write_text("m" * 32)
    text = text.replace("/etc/prometheus/alerts.yml", str(tmp_path / "alerts.yml"))
    text = text.replace("/prometheus/metrics-token", str(tmp_path / "metrics-token"))
    (tmp_path / "prometheus.yml").write_text(text)
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_gets_the_data_source_and_the_dashboard() -> None:
    provisioning = _mount_source("grafana", "/etc/grafana/provisioning")
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "sluice.yml").read_text())["providers"]
    dashboards = provider["options"]["path"]
    assert _mount_source("grafana", f"{dashboards}/sluice.json") == DOCKER / "grafana-dashboard.json"
