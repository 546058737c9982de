"""The scale-out cluster of the acceptance tests (issue #15): 3 `sluice gateway` replica processes
and 2 `sluice worker` processes of the demo model, each worker linked to every replica, on the
session's embedded broker, a fresh PostgreSQL database and a fresh Redis key prefix.

One cluster per test module (module scope): the machine has 2 shared cores, and starting five
processes costs tens of seconds, so the tests of a module share one and each makes its own
tenants. A module whose tests kill replicas restarts them (`Cluster.start_replica`) before the
next test. Without $SLUICE_TEST_POSTGRES_URL or $SLUICE_TEST_REDIS_URL the tests are skipped
(several replica processes cannot share one SQLite file, and the shared state needs Redis).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice_lab.experiments.cluster import Cluster, ClusterSpec, drop_redis_prefix, postgres_execute, start_cluster

POSTGRES_URL = os.environ.get("SLUICE_TEST_POSTGRES_URL", "")
REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "")
LEASE_S = 2.0  # short, so a killed replica's holds come back within a test
# The consumer group's session, shorter than the 6 s default (Apache Kafka's minimum; Tansu takes
# any): Tansu moves a dead member's partitions, and lets a restarted one rejoin, after ~1.7-2x the
# session, so each kill and restart here rebalances in ~5 s instead of ~10 s. Not shorter: a
# replica starved of CPU for a whole session on the busy test machine would be dropped from the
# group and cost a rebalance of its own.
KAFKA_ENV = (("SLUICE_KAFKA_SESSION_TIMEOUT_MS", "3000"), ("SLUICE_KAFKA_HEARTBEAT_INTERVAL_MS", "1000"))
ADMIN_TOKEN = "scaleout-tests-admin-" + "s" * 24
WORKER_SECRET = "scaleout-tests-worker-secret-0123456789"


def _require_services() -> None:
    missing = [name for name, value in (("SLUICE_TEST_POSTGRES_URL", POSTGRES_URL),
                                        ("SLUICE_TEST_REDIS_URL", REDIS_URL)) if not value]
    if not missing:
        return
    message = f"{' and '.join(missing)} not set: the scale-out cluster needs PostgreSQL and Redis"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def postgres_database() -> Iterator[str]:
    """A new, empty PostgreSQL database for the module (sqlalchemy URL); dropped afterwards."""
    _require_services()
    name = f"sluice_scaleout_{uuid.uuid4().hex[:10]}"
    asyncio.run(postgres_execute(POSTGRES_URL, f'CREATE DATABASE "{name}"'))
    base, _, _ = POSTGRES_URL.rpartition("/")
    try:
        yield f"{base}/{name}".replace("postgresql://", "postgresql+asyncpg://", 1)
    finally:
        asyncio.run(postgres_execute(POSTGRES_URL, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="module")
def shared_prefix() -> Iterator[str]:
    _require_services()
    prefix = f"sluice-scaleout-{secrets.token_hex(5)}"
    yield prefix
    asyncio.run(drop_redis_prefix(REDIS_URL, prefix))


def cluster_spec(workdir: Path, model_dir: Path, bootstrap_servers: str, database_url: str, prefix: str,
                 **overrides: object) -> ClusterSpec:
    return ClusterSpec(
        workdir=workdir, model_dir=model_dir, bootstrap_servers=bootstrap_servers, database_url=database_url,
        shared_url=REDIS_URL, shared_prefix=prefix, admin_token=ADMIN_TOKEN, worker_secret=WORKER_SECRET,
        lease_s=LEASE_S, topic_prefix=f"so{uuid.uuid4().hex[:8]}", env=KAFKA_ENV, **overrides)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster_overrides() -> dict[str, object]:
    """ClusterSpec fields a module changes (override this fixture in the module)."""
    return {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, bootstrap_servers: str,
            postgres_database: str, shared_prefix: str, cluster_overrides: dict[str, object]) -> Iterator[Cluster]:
    spec = cluster_spec(tmp_path_factory.mktemp("cluster"), demo_model_dir, bootstrap_servers, postgres_database,
                        shared_prefix, **cluster_overrides)
    with start_cluster(spec) as running:
        yield running
