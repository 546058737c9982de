"""The database is the source of truth for batch work: the embedded broker (memory storage) is
restarted on the same port during a batch, losing every queued record, its topics and committed
offsets, and still every accepted batch line (accepted before or after the restart, and across a
gateway restart) completes exactly once; a failing commit is logged once per condition, not per try."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from dispatch.test_queue import collect
from dispatch.test_queue import request as queued_request

from sluice.broker import EmbeddedBroker, free_port
from sluice.gateway.queueing.kafka import RequestLog, ensure_topics
from sluice.protocol import Priority
from sluice.settings import KafkaSettings, SchedulerSettings

from .conftest import FaultGateway, fault_settings, jsonl, open_gateway, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def restart(broker: EmbeddedBroker) -> None:
    broker.stop()
    time.sleep(0.5)
    broker.start()  # same port, memory storage: empty, as after a crash


def check_every_line_once(rows: list[dict[str, Any]], n: int) -> None:
    assert sorted(r["custom_id"] for r in rows) == sorted(f"c{i}" for i in range(n))
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in rows)


# A tiny in-memory backlog keeps most lines in Kafka, so the restart really loses them.
BACKLOG = SchedulerSettings(aging_s=0.0, max_backlog_per_class=2)


async def test_batches_complete_after_a_broker_restart(own_broker: EmbeddedBroker, demo_model_dir: Path,
                                                       database_url: str, worker_port: int, worker: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sluice.gateway")
    settings = fault_settings(own_broker.bootstrap_servers, demo_model_dir, database_url, scheduler=BACKLOG)
    async for gw in open_gateway(settings, worker_port):
        # The worker is drained while the first batch is queued, so the restart finds most of its
        # lines still in the broker (on a fast machine they would all be answered before it).
        assert (await gw.client.post("/admin/workers/fw/drain", headers=gw.admin)).status_code == 200
        before = await _create(gw, 24)
        consumer = gw.backend._consumers[Priority.BATCH]
        await wait_for(lambda c=consumer: c.paused, 60, "the gateway's batch backlog to fill")
        await asyncio.to_thread(restart, own_broker)
        assert (await gw.client.post("/admin/workers/fw/undrain", headers=gw.admin)).status_code == 200
        await wait_for(lambda b=gw.backend: b.batch_lines.requeued_lines > 0, 120, "the lost lines to be re-enqueued")
        after = await _create(gw, 6)
        for batch_id, n in ((before, 24), (after, 6)):
            done = await gw.wait_done(batch_id, timeout=240)
            assert done.status == "completed", done
            assert done.request_counts.completed == n and done.request_counts.failed == 0
            check_every_line_once(await gw.rows(done), n)
        assert gw.backend.batch_lines.requeued_lines > 0  # the lines really were lost, and came back
    commit_failures = [r for r in caplog.records if "committing" in r.getMessage() and "failed" in r.getMessage()]
    assert len(commit_failures) <= 6, [r.getMessage() for r in commit_failures]  # once per class and condition


async def test_batches_complete_when_the_broker_restarted_while_the_gateway_was_down(
        own_broker: EmbeddedBroker, demo_model_dir: Path, database_url: str, worker_port: int,
        worker: Any) -> None:
    settings = fault_settings(own_broker.bootstrap_servers, demo_model_dir, database_url, scheduler=BACKLOG)
    # No worker reaches this gateway (another worker port): the lines stay queued.
    async for gw in open_gateway(settings, free_port(), wait_worker=False):
        batch_id = await _create(gw, 8)
    await asyncio.to_thread(restart, own_broker)
    async for gw in open_gateway(settings, worker_port):
        done = await gw.wait_done(batch_id, timeout=240)
        assert done.status == "completed", done
        check_every_line_once(await gw.rows(done), 8)


async def _create(gw: FaultGateway, n: int) -> str:
    uploaded = await gw.sdk.files.create(file=("in.jsonl", jsonl(n, max_tokens=12)), purpose="batch")
    batch = await gw.sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                        completion_window="24h")
    return batch.id


async def test_a_request_appended_right_after_a_restart_is_kept(own_broker: EmbeddedBroker) -> None:
    """Tansu (memory storage) restarted acknowledges a record sent to a topic it no longer has and
    keeps nothing: the request log recreates the topic first, so the record can be read back
    (before the gateway's periodic queue check has had a chance to recreate anything). The topics
    are looked up only when the producer's broker connections changed (the restart broke them),
    not before every append."""
    settings = KafkaSettings(bootstrap_servers=own_broker.bootstrap_servers,
                             topic_prefix=f"rs{uuid.uuid4().hex[:8]}", partitions=2)
    await ensure_topics(settings)
    requests = RequestLog(settings, produce_timeout_s=5.0)
    await requests.start()
    try:
        for n in (10, 11, 12):  # the producer connects to the broker: a lookup or two at first
            await requests.append(queued_request(n))
        settled = requests.lookups
        assert settled >= 1
        for n in (13, 14, 15, 0):
            await requests.append(queued_request(n))
        assert requests.lookups == settled  # the same connections, so the same broker: no lookup
        await asyncio.to_thread(restart, own_broker)
        await requests.append(queued_request(1))
        assert requests.lookups > settled
    finally:
        await requests.stop()
    consumer, got = await collect(settings, Priority.STANDARD, 1)
    try:
        assert [r.request_id for r, _ in got] == ["r1"]  # the others went with the restart; r1 was kept
    finally:
        await consumer.stop()
