"""A batch line's result survives a failing database: the real database is made to fail while a
batch's results are being stored (SQLite: another connection holds an exclusive lock past the busy
timeout; PostgreSQL: every connection of the gateway is terminated again and again), and the batch
still completes with every line's real output, stored once and billed once."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
import time
from typing import Any

import pytest

from .conftest import FaultGateway, jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Longer than a line's wait for its usage write (5 s, quotas/usage.py WAIT_S) plus SQLite's 5 s
# busy timeout, so the result's own write really fails too.
FAULT_S = 12.0


def _lock_sqlite(path: str, seconds: float, locked: threading.Event) -> None:
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN EXCLUSIVE")
        locked.set()
        time.sleep(seconds)
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def _terminate_postgres(database: str, seconds: float, locked: threading.Event) -> None:
    import asyncpg

    async def run() -> None:
        base = os.environ["SLUICE_TEST_POSTGRES_URL"].replace("postgresql+asyncpg://", "postgresql://")
        conn = await asyncpg.connect(base)
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = $1 AND pid <> pg_backend_pid()", database)
                locked.set()
                await asyncio.sleep(0.02)
        finally:
            await conn.close()

    asyncio.run(run())


def start_database_fault(database_url: str, seconds: float) -> threading.Thread:
    locked = threading.Event()
    if database_url.startswith("sqlite"):
        target: Any = _lock_sqlite
        args: tuple[Any, ...] = (database_url.split("///", 1)[1], seconds, locked)
    else:
        target, args = _terminate_postgres, (database_url.rsplit("/", 1)[1], seconds, locked)
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    assert locked.wait(30), "the database fault did not start"
    return thread


async def test_results_survive_a_failing_database(gateway: FaultGateway, database_url: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.gateway.queueing.acceptance")
    sdk = gateway.sdk
    uploaded = await sdk.files.create(file=("in.jsonl", jsonl(16, max_tokens=16)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                     completion_window="24h")
    fault = start_database_fault(database_url, FAULT_S)
    await asyncio.to_thread(fault.join, 60)
    done = await gateway.wait_done(batch.id)
    assert any("storing the result of" in r.getMessage() for r in caplog.records), \
        "the fault never hit a result being stored"

    assert done.status == "completed", done
    assert done.request_counts.completed == 16 and done.request_counts.failed == 0
    rows = await gateway.rows(done)
    assert sorted(r["custom_id"] for r in rows) == sorted(f"c{i}" for i in range(16))
    billed = 0
    for row in rows:
        body = row["response"]["body"]
        assert body["object"] == "text_completion"  # the line's own endpoint, not chat
        usage = body["usage"]
        assert usage["completion_tokens"] >= 1 and body["choices"][0]["text"] != ""
        billed += usage["total_tokens"]
    # Billed once per line: the tenant's usage equals the sum of what its lines report.
    auth = {"authorization": f"Bearer {sdk.api_key}"}
    usage_rows = (await gateway.client.get("/v1/usage", headers=auth)).json()["data"]
    assert sum(r["prompt_tokens"] + r["completion_tokens"] for r in usage_rows) == billed
