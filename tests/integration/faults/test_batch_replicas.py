"""Batches with two gateway replicas in one consumer group (the embedded broker, one database,
the real Redis of $SLUICE_TEST_REDIS_URL; skipped without it): the batch topic's partitions are
split between them; each replica's lost-lines audit leaves the lines of the other's partitions
alone; a cancel made on one replica stops the lines the other holds; a `validating` batch of a
live replica is not failed by another replica's recovery, one of a dead replica is."""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import pytest

from sluice.broker import free_port
from sluice.gateway.batches.models import Batch
from sluice.gateway.db.base import utcnow
from sluice.protocol import Priority
from sluice.settings import KafkaSettings, Settings, SharedSettings

from .conftest import FaultGateway, fault_settings, jsonl, open_gateway, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "")
T = TypeVar("T")


@pytest.fixture
def replica_settings(bootstrap_servers: str, demo_model_dir: Path, database_url: str) -> Settings:
    if not REDIS_URL:
        pytest.skip("SLUICE_TEST_REDIS_URL is not set (e.g. redis://127.0.0.1:6379/0); no shared store")
    # Tansu takes a short session (Apache Kafka would want 6 s): the group settles in seconds.
    kafka = KafkaSettings(bootstrap_servers=bootstrap_servers, topic_prefix=f"r{uuid.uuid4().hex[:10]}",
                          consumer_group=f"grp-{uuid.uuid4().hex[:6]}", partitions=2, produce_timeout_s=2.0,
                          session_timeout_ms=1500, heartbeat_interval_ms=500)
    shared = SharedSettings(url=REDIS_URL, lease_s=2.0, prefix=f"sluice-test-{secrets.token_hex(6)}")
    return fault_settings(bootstrap_servers, demo_model_dir, database_url, kafka=kafka, shared=shared)


@asynccontextmanager
async def replica(settings: Settings) -> AsyncIterator[FaultGateway]:
    """One replica; no worker reaches it (its own worker port), so the lines it runs stay queued."""
    gateways = open_gateway(settings, free_port(), wait_worker=False)
    gw = await gateways.__anext__()
    try:
        yield gw
    finally:
        await gateways.aclose()


def split(a: FaultGateway, b: FaultGateway) -> bool:
    mine, theirs = a.backend._consumers[Priority.BATCH].owned, b.backend._consumers[Priority.BATCH].owned
    return bool(mine) and bool(theirs) and not mine & theirs


async def test_a_cancel_on_one_replica_stops_the_lines_another_holds(replica_settings: Settings) -> None:
    async with replica(replica_settings) as a, replica(replica_settings) as b:
        await wait_for(lambda: split(a, b), 60, "the group to split the batch partitions")
        uploaded = await a.sdk.files.create(file=("in.jsonl", jsonl(6)), purpose="batch")
        batch = await a.sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                           completion_window="24h")
        # The lines (one tenant: one key, one partition) are held by that partition's owner alone.
        await wait_for(lambda: {a.backend.dispatcher.num_jobs, b.backend.dispatcher.num_jobs} == {0, 6}, 60,
                       "one replica to hold every line")
        holder, other = (a, b) if a.backend.dispatcher.num_jobs else (b, a)
        # The lost-lines audit of each replica covers its own partitions only: the other replica
        # must not take the lines it neither holds nor owns for lost (and queue them again).
        for gw in (other, holder):
            check = await on_app(gw, gw.backend._consumers[Priority.BATCH].check)
            assert check.caught_up and not check.lost
            await on_app(gw, gw.backend.batch_lines.requeue_lost)
            assert gw.backend.batch_lines.requeued_lines == 0
        cancelled = await other.sdk.batches.cancel(batch.id)  # asked of the replica that holds nothing
        assert cancelled.status in ("cancelling", "cancelled")
        done = await holder.wait_done(batch.id, timeout=60)
        assert done.status == "cancelled"
        rows = await holder.rows(done)
        assert sorted(r["custom_id"] for r in rows) == [f"c{i}" for i in range(6)]  # each once
        assert {r["error"]["code"] for r in rows} == {"batch_cancelled"}
        assert holder.backend.dispatcher.num_jobs == 0


async def test_a_validating_batch_is_failed_only_once_its_creator_is_dead(replica_settings: Settings) -> None:
    async with replica(replica_settings) as survivor:
        async with replica(replica_settings) as creator:
            ids = {"live": await _validating(creator, creator.app.state.services.shared.replica),
                   "dead": await _validating(creator, "a-replica-that-never-lived"),
                   "legacy": await _validating(creator, None)}
            await on_app(survivor, survivor.app.state.services.batches.recover)  # another replica starting
            assert await _status(creator, ids["live"]) == "validating"
            assert await _status(creator, ids["dead"]) == "failed"
            assert await _status(creator, ids["legacy"]) == "failed"
            assert await on_app(creator, creator.app.state.services.batches.fail_orphaned) == 0  # its own is left to it
        # The creator stopped (its lease given up): the survivor's sweep fails its batch.
        assert await on_app(survivor, survivor.app.state.services.batches.fail_orphaned) == 1
        assert await _status(survivor, ids["live"]) == "failed"


async def on_app(gw: FaultGateway, func: Callable[[], Awaitable[T]]) -> T:
    """Runs `func` on the app's own event loop (the test client runs it in a portal thread)."""
    return await asyncio.to_thread(gw.client.blocking_portal.call, func)


async def _validating(gw: FaultGateway, creator: str | None) -> str:
    batch_id = f"batch_{uuid.uuid4().hex[:20]}"

    async def insert() -> None:
        now = utcnow()
        async with gw.app.state.services.session_factory() as session, session.begin():
            session.add(Batch(id=batch_id, tenant_id=gw.tenant_id, input_file_id="file_x",
                              endpoint="/v1/completions", completion_window="24h", total=1, created_at=now,
                              expires_at=now, status="validating", created_by=creator))

    await on_app(gw, insert)
    return batch_id


async def _status(gw: FaultGateway, batch_id: str) -> str:
    async def read() -> str:
        async with gw.app.state.services.session_factory() as session:
            row = await session.get(Batch, batch_id)
        assert row is not None
        return row.status

    return await on_app(gw, read)
