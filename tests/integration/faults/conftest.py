"""A whole gateway for the fault tests: the Batch API app in process (Litestar test client), a
real KafkaBackend on the session's embedded broker, a real database and a real worker process.

Each test gets a fresh database and topic prefix; the worker (module-scoped) reconnects to each
test's gateway on the same worker port.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from dispatch.conftest import StartWorker, make_settings, start_worker, wait_for  # noqa: F401
from litestar.testing import AsyncTestClient

from sluice.broker import EmbeddedBroker, free_port
from sluice.gateway.app import create_app
from sluice.gateway.batches import batch_components
from sluice.gateway.queueing.acceptance import KafkaBackend
from sluice.settings import AdminSettings, DatabaseSettings, Settings, TenantSeed

ADMIN_TOKEN = "slc-admin-fault-tests-" + "x" * 24
FINAL = ("completed", "failed", "cancelled", "expired")


def jsonl(n: int, *, url: str = "/v1/completions", max_tokens: int = 8, model: str = "demo") -> bytes:
    lines = []
    for i in range(n):
        body: dict[str, object] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
        if url == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": f"line {i}"}]
        else:
            body["prompt"] = f"line {i} says"
        lines.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(lines) + "\n").encode()


@dataclass
class FaultGateway:
    settings: Settings
    backend: KafkaBackend
    client: AsyncTestClient[Any]
    app: Any
    sdk: openai.AsyncOpenAI  # tenant "acme"
    tenant_id: str
    admin: dict[str, str]

    async def wait_done(self, batch_id: str, timeout: float = 180.0) -> Any:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            batch = await self.sdk.batches.retrieve(batch_id)
            if batch.status in FINAL:
                return batch
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"batch {batch_id} still {batch.status}: {batch.request_counts}")
            await asyncio.sleep(0.2)

    async def rows(self, batch: Any) -> list[dict[str, Any]]:
        """Every output and error line of a finished batch."""
        out: list[dict[str, Any]] = []
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                content = (await self.sdk.files.content(file_id)).content.decode()
                out += [json.loads(x) for x in content.splitlines() if x]
        return out


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A broker of this test alone: stopping or restarting it must not disturb the session's broker."""
    broker = EmbeddedBroker(log_path=tmp_path / "tansu.log").start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def worker_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(start_worker: StartWorker, demo_model_dir: Path, worker_port: int) -> Any:  # noqa: F811
    return start_worker(demo_model_dir, worker_port, "fw", "--max-num-seqs", "8")


async def open_gateway(settings: Settings, worker_port: int, *, wait_worker: bool = True
                       ) -> AsyncIterator[FaultGateway]:
    batches = batch_components(settings)
    backend = KafkaBackend(settings, batch_handler=batches.handler, worker_port=worker_port)


    app = create_app(settings, backend, batches=batches)
    async with AsyncTestClient(app, base_url="http://sluice.test") as client:
        if wait_worker:
            await wait_for(lambda: "fw" in backend.dispatcher.workers, 120, "the worker to register")
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        tenants = (await client.get("/admin/tenants", headers=admin)).json()
        ids = {t["name"]: t["id"] for t in (tenants["data"] if isinstance(tenants, dict) else tenants)}
        created = await client.post(f"/admin/tenants/{ids['acme']}/keys", json={"name": "test"}, headers=admin)
        assert created.status_code == 201, created.text
        sdk = openai.AsyncOpenAI(api_key=created.json()["key"], base_url="http://sluice.test/v1",
                                 http_client=client, max_retries=0)
        yield FaultGateway(settings, backend, client, app, sdk, ids["acme"], admin)


def fault_settings(bootstrap_servers: str, model_dir: Path, database_url: str, **sections: Any) -> Settings:
    return make_settings(
        bootstrap_servers, model_dir,
        database=DatabaseSettings(url=database_url),
        admin=AdminSettings(token=ADMIN_TOKEN),
        tenants=(TenantSeed(name="acme"),),
        **sections,
    )


@pytest.fixture
async def gateway(bootstrap_servers: str, demo_model_dir: Path, database_url: str, worker_port: int,
                  worker: Any) -> AsyncIterator[FaultGateway]:
    settings = fault_settings(bootstrap_servers, demo_model_dir, database_url)
    async for gw in open_gateway(settings, worker_port):
        yield gw
