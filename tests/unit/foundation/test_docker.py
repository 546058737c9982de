"""No Docker engine runs here, so the compose file is checked statically: every service's
command parses with the real `sluice` CLI, every SLUICE_* variable is a real setting read by the
process it is given to, gateway and worker serve one mounted model under one name, and every file
a Dockerfile copies exists in the repository."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from sluice.cli import build_parser
from sluice.errors import SluiceError
from sluice.gateway.launch.cli import worker_setup
from sluice.settings import load_settings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())


def _resolve(value: str) -> str:
    # ${VAR:?message} / ${VAR} → a placeholder value, as compose would substitute.
    return re.sub(r"\$\{[^}]+\}", "placeholder-long-enough-for-any-secret", str(value))


def _args(service: str) -> argparse.Namespace:
    return build_parser().parse_args([_resolve(part) for part in COMPOSE["services"][service]["command"][1:]])


def _env(service: str) -> dict[str, str]:
    env = {key: _resolve(value) for key, value in COMPOSE["services"][service]["environment"].items()}
    assert env.pop("SLUICE_CONFIG_DIR") == "/app/config"  # the image's copy of config/
    return env


def _mounts(service: str) -> dict[PurePosixPath, str]:
    """Container path -> host source of each read-only bind mount."""
    mounts = {}
    for volume in COMPOSE["services"][service].get("volumes", []):
        source, target, mode = volume.rsplit(":", 2) if volume.count(":") >= 2 else (volume, "", "")
        if mode == "ro":
            mounts[PurePosixPath(target)] = source
    return mounts


def _served_by_gateway() -> dict[str, PurePosixPath]:
    """Model name -> directory, as `sluice serve` picks them (its --model, else models.toml)."""
    args = _args("gateway-1")
    if args.model is not None:
        return {PurePosixPath(args.model).name: PurePosixPath(args.model)}
    settings = load_settings(REPO / "config", environ=_env("gateway-1"))
    return {m.name: PurePosixPath(m.path) for m in settings.models}


def _perturbed(raw: str) -> str:
    """Another valid-looking value of the same TOML type as `raw`."""
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw + "-changed"
    if isinstance(value, bool):
        return "false" if value else "true"
    if isinstance(value, int):
        return str(value + 1)
    if isinstance(value, float):
        return str(value / 2 if value else 0.5)
    return raw + "-changed"


GATEWAYS = ["gateway-1", "gateway-2"]


def test_compose_has_kafka_kraft_postgres_gateway_and_gpu_worker() -> None:
    services = COMPOSE["services"]
    assert set(services) >= {"kafka", "postgres", "redis", *GATEWAYS, "worker"}
    assert "controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


@pytest.mark.parametrize("service", [*GATEWAYS, "worker"])
def test_service_command_parses_with_the_real_cli(service: str) -> None:
    command = COMPOSE["services"][service]["command"]
    assert command[0] == "sluice"
    args = build_parser().parse_args([_resolve(part) for part in command[1:]])
    assert callable(args.handler)


@pytest.mark.parametrize("service", [*GATEWAYS, "worker"])
def test_service_environment_is_made_of_real_settings(service: str, tmp_path: Path) -> None:
    env = _env(service)
    settings = load_settings(REPO / "config", environ=env)  # raises ConfigError on an unknown key
    if service in GATEWAYS:
        assert settings.shared.url.startswith("redis://")  # replicas share quotas, slots, streams
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
    for service in (*GATEWAYS, "worker"):
        build = COMPOSE["services"][service]["build"]
        assert (REPO / "docker" / build["context"]).resolve() == REPO
        assert (REPO / build["dockerfile"]).is_file()


def test_gateway_and_worker_mount_one_model_directory() -> None:
    gateway, worker = _mounts("gateway-1"), _mounts("worker")
    shared = {target for target in gateway if worker.get(target) == gateway[target]}
    assert shared, f"no read-only model mount common to gateway {gateway} and worker {worker}"


def test_gateway_serves_the_mounted_model_not_the_demo() -> None:
    mounts = _mounts("gateway-1")
    served = _served_by_gateway()
    for name, path in served.items():
        assert any(path == target or target in path.parents for target in mounts), (
            f"the gateway serves {name} from {path}, which is not mounted into its container")
    models = load_settings(REPO / "config", environ=_env("gateway-1")).models
    demo_paths = {PurePosixPath(m.path) for m in models if m.demo}
    assert not demo_paths & set(served.values()), "the gateway serves the demo model"


def test_worker_registers_under_a_name_the_gateway_serves() -> None:
    args = _args("worker")
    model = PurePosixPath(args.model)
    assert any(model == target or target in model.parents for target in _mounts("worker"))
    name = args.served_model_name or model.name
    served = _served_by_gateway()
    assert name in served, f"the worker registers {name!r}; the gateway serves {sorted(served)}"
    assert served[name] == model, "gateway and worker read the model from different paths"


def _worker_outcome(env: dict[str, str], model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    for key in [k for k in __import__("os").environ if k.startswith("SLUICE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLUICE_CONFIG_DIR", str(REPO / "config"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = _args("worker")
    args.model = str(model_dir)
    try:
        config, options = worker_setup(args)
    except (SluiceError, ValueError) as exc:  # a value the worker validated (so it read it)
        return f"refused: {exc}"
    return (config, options)


def test_every_worker_variable_changes_what_the_worker_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env("worker")
    env.setdefault("SLUICE_GATEWAY_WORKER_SECRET", "s" * 32)  # the operator supplies it
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    baseline = _worker_outcome(env, model_dir, monkeypatch)
    assert not isinstance(baseline, str), baseline
    for variable, value in env.items():
        changed = _worker_outcome({**env, variable: _perturbed(value)}, model_dir, monkeypatch)
        assert changed != baseline, f"{variable} given to the worker has no effect on it"


def test_gateway_gets_no_engine_variable_it_would_not_read() -> None:
    if getattr(_args("gateway-1"), "workers", 0) != 0:
        return  # local workers (sluice serve) read every [engine] key
    # With no local workers the gateway reads [engine] only for the context length it enforces.
    unread = [v for v in _env("gateway-1") if v.startswith("SLUICE_ENGINE_") and v != "SLUICE_ENGINE_MAX_MODEL_LEN"]
    assert not unread, f"engine settings given to a gateway without local workers: {unread}"
