"""No Docker engine runs here, so the compose file is checked statically: every service's
command parses with the real `sluice` CLI, every SLUICE_* variable is a real setting, and every
file a Dockerfile copies exists in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from sluice.cli import build_parser
from sluice.settings import load_settings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())


def _resolve(value: str) -> str:
    # ${VAR:?message} / ${VAR} → a placeholder value, as compose would substitute.
    return re.sub(r"\$\{[^}]+\}", "placeholder", str(value))


def test_compose_has_kafka_kraft_postgres_gateway_and_gpu_worker() -> None:
    services = COMPOSE["services"]
    assert set(services) >= {"kafka", "postgres", "gateway", "worker"}
    assert "controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


@pytest.mark.parametrize("service", ["gateway", "worker"])
def test_service_command_parses_with_the_real_cli(service: str) -> None:
    command = COMPOSE["services"][service]["command"]
    assert command[0] == "sluice"
    args = build_parser().parse_args([_resolve(part) for part in command[1:]])
    assert callable(args.handler)


@pytest.mark.parametrize("service", ["gateway", "worker"])
def test_service_environment_is_made_of_real_settings(service: str, tmp_path: Path) -> None:
    env = {key: _resolve(value) for key, value in COMPOSE["services"][service]["environment"].items()}
    assert env.pop("SLUICE_CONFIG_DIR") == "/app/config"
    settings = load_settings(REPO / "config", environ=env)  # raises ConfigError on an unknown key
    if service == "gateway":
        assert settings.kafka.bootstrap_servers == "kafka:9092"
        assert settings.kafka.enable_idempotence is True
        assert settings.database.url.startswith("postgresql+asyncpg://")


@pytest.mark.parametrize("dockerfile", ["Dockerfile.gateway", "Dockerfile.worker"])
def test_dockerfiles_copy_paths_that_exist(dockerfile: str) -> None:
    text = (REPO / "docker" / dockerfile).read_text()
    copies = re.findall(r"^COPY\s+(.+?)\s+\S+$", text, flags=re.MULTILINE)
    assert copies
    for sources in copies:
        for source in sources.split():
            assert (REPO / source).exists(), f"{dockerfile} copies {source}, which is not in the repo"
    cmd = re.search(r"^CMD\s+(\[.+\])$", text, flags=re.MULTILINE)
    assert cmd is not None
    parts = yaml.safe_load(cmd.group(1))
    build_parser().parse_args(parts[1:])


def test_build_contexts_point_at_the_repo() -> None:
    for service in ("gateway", "worker"):
        build = COMPOSE["services"][service]["build"]
        assert (REPO / "docker" / build["context"]).resolve() == REPO
        assert (REPO / build["dockerfile"]).is_file()
