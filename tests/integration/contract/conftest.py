"""`sluice serve` as a real process for the API-contract tests: the served OpenAPI document, the
answers the server really sends, and a schemathesis fuzz run over every route.

The broker is the session fixture's; the database a fresh SQLite file; one local worker serves
the demo model. One server for the package; tests that need a tenant make their own with
`Served.new_tenant` (the fuzz run's admin pass deletes tenants and revokes keys it finds).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.broker import free_port

REPO = Path(__file__).resolve().parents[3]
# Free-form on purpose: SLUICE_ADMIN_TOKEN need not look like a generated token (`slc-admin-...`).
MAX_BODY_BYTES = 2**20
ADMIN_TOKEN = "contract-tests-admin-" + "z" * 24


@dataclass
class Served:
    base_url: str
    log_path: Path

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60
        )

    def new_tenant(self, **quotas: int) -> tuple[str, str]:
        """A fresh tenant with these quotas; returns (tenant id, key)."""
        with self.admin() as admin:
            tenant = admin.post("/admin/tenants", json={"name": f"c-{secrets.token_hex(4)}", "quotas": quotas})
            assert tenant.status_code == 201, tenant.text
            key = admin.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={"name": "contract"})
            assert key.status_code == 201, key.text
        return tenant.json()["id"], key.json()["key"]

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"authorization": f"Bearer {key}"}, timeout=60)

    def wait_for_worker(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        with self.admin() as admin:
            while time.monotonic() < deadline:
                if any(w.get("alive") for w in admin.get("/admin/workers").json()["workers"]):
                    return
                time.sleep(0.2)
        raise AssertionError(f"no worker came back; see {self.log_path}")

    def schema(self) -> dict[str, Any]:
        answer = httpx.get(self.base_url + "/schema/openapi.json", timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()


def _write_config(directory: Path, model_dir: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sluice.toml").write_text(
        "[dispatch]\nlocal_workers = 1\nheartbeat_interval_s = 0.5\nheartbeat_timeout_s = 5.0\n"
        "[engine]\nmax_num_seqs = 16\nmax_num_batched_tokens = 512\n"
        # the fuzz run sends wrong admin tokens by design; the sign-in limiter would lock the
        # shared server's admin client out for a minute (tests/integration/gateway covers it)
        "[admin]\nmax_failed_sign_ins = 1000000\n"
    )
    (directory / "models.toml").write_text(f'[[models]]\nname = "demo"\npath = "{model_dir}"\n')
    (directory / "tenants.toml").write_text("")
    return directory


def _wait_ready(base_url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 240
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"serve exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(base_url + "/admin/workers", headers=headers, timeout=10).json().get("workers"):
                return
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"serve did not become ready with a worker; see {log_path}")


@pytest.fixture(scope="package")
def served(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, bootstrap_servers: str
) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("contract")
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO / "src"),
        OMP_NUM_THREADS="1",
        SLUICE_CONFIG_DIR=str(_write_config(directory / "config", demo_model_dir)),
        SLUICE_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers,
        SLUICE_KAFKA_TOPIC_PREFIX=f"contract{time.monotonic_ns()}",
        SLUICE_DATABASE_URL=f"sqlite+aiosqlite:///{directory / 'sluice.db'}",
        SLUICE_GATEWAY_WORKER_PORT=str(free_port()),
        SLUICE_GATEWAY_RECORD_LOG_PATH="",
        SLUICE_ADMIN_TOKEN=ADMIN_TOKEN,
        SLUICE_GATEWAY_MAX_BODY_BYTES=str(MAX_BODY_BYTES),
    )
    log_path = directory / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "serve", "--port", str(port)],
            cwd=directory,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base_url, process, log_path)
        yield Served(base_url, log_path)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
