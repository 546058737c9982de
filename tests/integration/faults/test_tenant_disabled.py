"""Disabling a tenant stops its batch work at once: the lines that have not run are not run and not
billed, each is answered `tenant_disabled`, and the batch ends `failed` with that error."""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy import select

from sluice.gateway.batches.models import Batch, BatchResult
from sluice.gateway.db.session import make_engine, make_session_factory

from .conftest import FaultGateway, jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LINES = 40


async def test_disabling_a_tenant_stops_its_batches(gateway: FaultGateway, database_url: str) -> None:
    sdk = gateway.sdk
    uploaded = await sdk.files.create(file=("in.jsonl", jsonl(LINES, max_tokens=48)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                     completion_window="24h")
    disabled = await gateway.client.patch(f"/admin/tenants/{gateway.tenant_id}", json={"enabled": False},
                                          headers=gateway.admin)
    assert disabled.status_code == 200, disabled.text

    # The tenant's key no longer works, so the batch is read from the database.
    engine = make_engine(database_url)
    sessions = make_session_factory(engine)
    try:
        deadline = asyncio.get_running_loop().time() + 120
        while True:
            async with sessions() as session:
                row = await session.get(Batch, batch.id)
                assert row is not None
                if row.status in ("completed", "failed", "cancelled", "expired"):
                    results = (await session.scalars(
                        select(BatchResult).where(BatchResult.batch_id == batch.id))).all()
                    break
            assert asyncio.get_running_loop().time() < deadline, f"batch still {row.status}"
            await asyncio.sleep(0.2)
    finally:
        await engine.dispose()

    assert row.status == "failed" and row.failed_at is not None
    assert [e["code"] for e in row.errors or []] == ["tenant_disabled"]
    assert sorted(r.custom_id for r in results) == sorted(f"c{i}" for i in range(LINES))  # each once
    stopped = [json.loads(r.line) for r in results if not r.ok]
    assert stopped, "every line ran although the tenant was disabled at once"
    assert {s["error"]["code"] for s in stopped} == {"tenant_disabled"}
    # Nothing of it is left running or reserved.
    assert not any(job.request.batch_id == batch.id for job in
                   [p.payload for p in gateway.backend.dispatcher.scheduler.items()])
    assert gateway.app.state.services.quotas.live(gateway.tenant_id) == (0, 0)
