"""A real gateway over HTTP: uvicorn in a background thread on a free port, the demo model served
by LocalEngineBackend, a fresh SQLite database migrated by Alembic. One server per test module;
each test creates its own tenants, so tests do not see each other's quotas or usage.

A module can run its tests against both kinds of shared state by overriding `shared_mode` with a
module-scoped fixture parametrized over "in-process" and "redis" (the Redis one needs
$SLUICE_TEST_REDIS_URL: skipped without it, a failure under CI=true).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sluice_testing import serve_app

from sluice.gateway.app import create_app
from sluice.gateway.queueing.local import LocalEngineBackend
from sluice.settings import AdminSettings, DatabaseSettings, DispatchSettings, GatewaySettings, Settings, SharedSettings

ENGINE_OPTIONS = {"max_num_seqs": 32, "kv_cache_bytes": 32 * 2**20, "max_num_batched_tokens": 512}


@dataclass
class Gateway:
    base_url: str
    admin_token: str
    database_url: str
    app: Any
    metrics_token: str = ""
    _names: int = 0
    secrets_seen: list[str] = field(default_factory=list)

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"authorization": f"Bearer {self.admin_token}"}, timeout=60
        )

    def tenant(self, **body: Any) -> tuple[dict[str, Any], str]:
        """Creates a tenant (unique name) and one key; returns (tenant JSON, key)."""
        self._names += 1
        body.setdefault("name", f"t{self._names}-{secrets.token_hex(3)}")
        with self.admin() as client:
            created = client.post("/admin/tenants", json=body)
            assert created.status_code == 201, created.text
            tenant = created.json()
            key = client.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": "test"})
            assert key.status_code == 201, key.text
        self.secrets_seen.append(key.json()["key"])
        return tenant, key.json()["key"]

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"authorization": f"Bearer {key}"}, timeout=60)





@pytest.fixture(scope="module")
def shared_mode() -> str:
    return "in-process"


@pytest.fixture(scope="module")
def gateway_options() -> dict[str, Any]:
    """More `GatewaySettings` fields for this module's gateway (override it in a module)."""
    return {}


@pytest.fixture(scope="module")
def engine_options() -> dict[str, Any]:
    """The local engine's options for this module's gateway (override it in a module)."""
    return ENGINE_OPTIONS


def _shared_settings(mode: str) -> SharedSettings:
    if mode == "in-process":
        return SharedSettings()
    url = os.environ.get("SLUICE_TEST_REDIS_URL", "")
    if not url:
        if os.environ.get("CI") == "true":
            pytest.fail("SLUICE_TEST_REDIS_URL is not set: under CI=true the Redis mode must run")
        pytest.skip("SLUICE_TEST_REDIS_URL is not set: no Redis for the shared-state mode")
    return SharedSettings(url=url, prefix=f"sluice-test-{secrets.token_hex(6)}")


@contextlib.contextmanager
def start_gateway(directory: Path, models: dict[str, Path], engine_options: dict[str, Any], *,
                  shared_mode: str = "in-process", gateway_options: dict[str, Any] | None = None,
                  dispatch_options: dict[str, Any] | None = None) -> Iterator[Gateway]:
    """A gateway over HTTP serving `models` (name -> directory) with a local engine each, its own
    SQLite database in `directory`; stopped on exit. `dispatch_options`: the local engines'
    dispatcher settings (`[dispatch]`)."""
    database_url = f"sqlite+aiosqlite:///{directory / 'sluice.db'}"
    admin_token = "slc-admin-" + secrets.token_urlsafe(32)
    metrics_token = "metrics-" + secrets.token_urlsafe(24)
    settings = Settings(
        gateway=GatewaySettings(**{
            "max_body_bytes": 256 * 1024, "key_cache_ttl_s": 30.0, "metrics_token": metrics_token,
            **(gateway_options or {}),
        }),
        admin=AdminSettings(token=admin_token),
        database=DatabaseSettings(url=database_url),
        shared=_shared_settings(shared_mode),
        dispatch=DispatchSettings(**(dispatch_options or {})),
    )
    # The backend's dispatcher takes the gateway's [dispatch] (its other sections are the app's).
    backend = LocalEngineBackend(models, engine_options, settings=Settings(dispatch=settings.dispatch))
    app = create_app(settings, backend)
    with serve_app(app) as base_url:
        yield Gateway(base_url, admin_token, database_url, app, metrics_token)
        if settings.shared.url:
            _remove_keys(settings.shared)


@pytest.fixture(scope="session")
def open_gateway() -> Callable[..., contextlib.AbstractContextManager[Gateway]]:
    """`start_gateway`, for a module that serves other models or engine options per parameter."""
    return start_gateway


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, shared_mode: str, gateway_options: dict[str, Any],
    engine_options: dict[str, Any],
) -> Iterator[Gateway]:
    with start_gateway(tmp_path_factory.mktemp("gateway"), {"demo": demo_model_dir}, engine_options,
                       shared_mode=shared_mode, gateway_options=gateway_options) as running:
        yield running


def _remove_keys(shared: SharedSettings) -> None:
    import redis

    client = redis.Redis.from_url(shared.url)
    try:
        keys = list(client.scan_iter(match=f"{shared.prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)
