"""One bad record never stops consumption: a batch line record whose handling raises a non-Kafka
exception (here the fair scheduler refuses its tenant weight of 0, as a record from a foreign or
older producer could carry) is answered with an error, and the lines behind it still run."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time

import pytest

from sluice.gateway.batches.models import Batch
from sluice.gateway.batches.views import line_request_id
from sluice.gateway.db.session import make_engine, make_session_factory
from sluice.protocol import GenerateRequest, Priority, SamplingParams

from .conftest import FaultGateway, jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_record_that_raises_does_not_stop_the_consumer(gateway: FaultGateway, database_url: str) -> None:
    # A runnable one-line batch, written straight to the database, whose only line is the bad record.
    now = dt.datetime.now(dt.UTC)
    engine = make_engine(database_url)
    try:
        async with make_session_factory(engine)() as session, session.begin():
            session.add(Batch(id="batch_bad0000000000000000000000", tenant_id=gateway.tenant_id,
                              input_file_id="file-none", endpoint="/v1/completions", completion_window="24h",
                              status="in_progress", total=1, created_at=now, in_progress_at=now,
                              expires_at=now + dt.timedelta(hours=24)))
    finally:
        await engine.dispose()
    bad = GenerateRequest(
        request_id=line_request_id("batch_bad0000000000000000000000", 1), tenant_id=gateway.tenant_id,
        model="demo", priority=Priority.BATCH, prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=4),
        cache_salt=gateway.tenant_id, arrival_time=time.time(), batch_id="batch_bad0000000000000000000000",
        custom_id="bad", tenant_weight=0.0,
    )
    # On the app's own event loop (the test client runs it in a portal thread): the producer lives there.
    await asyncio.to_thread(gateway.client.blocking_portal.call, gateway.backend.enqueue_batch_line, bad)

    sdk = gateway.sdk
    uploaded = await sdk.files.create(file=("in.jsonl", jsonl(3)), purpose="batch")
    good = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                    completion_window="24h")
    done = await gateway.wait_done(good.id)
    assert done.status == "completed" and done.request_counts.completed == 3

    broken = await gateway.wait_done("batch_bad0000000000000000000000")
    assert broken.request_counts.failed == 1 and broken.request_counts.completed == 0
    [row] = await gateway.rows(broken)
    assert row["custom_id"] == "bad" and row["error"]["code"] == "generation_failed"
    assert "could not handle" in row["error"]["message"]
    assert json.dumps(row).find("Traceback") < 0  # no internals in the answer
