"""A gateway installs without torch (`sluice[gateway]`, docker/Dockerfile.gateway): its settings load,
every gateway module imports, and the start-up's model check passes for models that are present.

The interpreter runs without this environment's site-packages (`python -S`) and with a copy of it
(links) that leaves out what only `sluice[worker]` brings: the packages are really absent, as in
the gateway image, rather than patched out of the import system."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
WORKER_ONLY = ("torch", "torchgen", "functorch", "triton", "nvidia", "accelerate", "gguf")

CHECK = """
import importlib, importlib.util, pkgutil, sys
from pathlib import Path
import msgspec
assert importlib.util.find_spec("torch") is None, "torch is importable: the check means nothing"
import sluice.gateway
failed = []
for module in pkgutil.walk_packages(sluice.gateway.__path__, "sluice.gateway."):
    try:
        importlib.import_module(module.name)
    except ImportError as exc:
        failed.append(f"{module.name}: {exc}")
assert not failed, failed
from sluice.gateway.launch.serve import prepare_models
from sluice.settings import load_settings
settings = load_settings(sys.argv[1], environ={})
present = Path(sys.argv[2])
(present / "config.json").write_text("{}")
prepare_models(msgspec.structs.replace(settings, models=tuple(
    msgspec.structs.replace(m, path=str(present)) for m in settings.models)))
print("ok")
"""


@pytest.fixture(scope="module")
def gateway_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This environment's site-packages without the worker's packages, as links."""
    target = tmp_path_factory.mktemp("gateway-site")
    for directory in map(Path, site.getsitepackages()):
        for entry in directory.iterdir():
            name = entry.name.split("-")[0].split(".")[0].lower()
            if name in WORKER_ONLY or name.startswith("nvidia_") or (target / entry.name).exists():
                continue
            (target / entry.name).symlink_to(entry)
    return target


def _run(gateway_site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{gateway_site}{os.pathsep}{ROOT / 'src'}"}
    return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, timeout=180, env=env,
                          cwd=ROOT)


def test_the_gateway_imports_and_checks_its_models_without_torch(gateway_site: Path, tmp_path: Path) -> None:
    done = _run(gateway_site, "-c", CHECK, str(ROOT / "config"), str(tmp_path))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_config_check_runs_without_torch(gateway_site: Path) -> None:
    done = _run(gateway_site, "-m", "sluice.cli", "config", "check", "--config", str(ROOT / "config"))
    assert done.returncode == 0, done.stderr[-3000:]
