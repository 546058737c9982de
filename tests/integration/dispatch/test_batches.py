"""The Batch API through the `openai` SDK: in-process gateway app, real broker, DB and worker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from litestar.testing import AsyncTestClient

from sluice.broker import free_port
from sluice.gateway.app import create_app
from sluice.gateway.batches import batch_components
from sluice.gateway.queueing.acceptance import KafkaBackend
from sluice.settings import AdminSettings, DatabaseSettings, QuotaSeed, TenantSeed

from .conftest import make_settings, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN_TOKEN = "slc-admin-dispatch-tests-" + "x" * 24


def jsonl(n: int, *, url: str = "/v1/chat/completions", max_tokens: int = 4) -> bytes:
    lines = []
    for i in range(n):
        body: dict[str, object] = {"model": "demo", "max_tokens": max_tokens, "temperature": 0}
        if url == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": f"line {i}"}]
        else:
            body["prompt"] = f"line {i}"
        lines.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def worker_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(start_worker, demo_model_dir: Path, worker_port: int):
    return start_worker(demo_model_dir, worker_port, "bw", "--max-num-seqs", "8")


@pytest.fixture
async def gateway(bootstrap_servers: str, demo_model_dir: Path, database_url: str, worker_port: int, worker):
    settings = make_settings(
        bootstrap_servers,
        demo_model_dir,
        database=DatabaseSettings(url=database_url),
        admin=AdminSettings(token=ADMIN_TOKEN),
        tenants=(TenantSeed(name="acme", default_class="standard"), TenantSeed(name="other"),
                 TenantSeed(name="narrow", quotas=QuotaSeed(max_concurrent=2))),
    )
    batches = batch_components(settings)
    backend = KafkaBackend(settings, batch_handler=batches.handler, worker_port=worker_port)


    app = create_app(settings, backend, batches=batches)
    async with AsyncTestClient(app, base_url="http://sluice.test") as client:
        await wait_for(lambda: "bw" in backend.dispatcher.workers, 120, "the worker to register")
        # Through the admin API: the app runs on the test client's own event loop (thread), and
        # asyncpg connections must stay on the loop that opened them.
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        tenants = (await client.get("/admin/tenants", headers=admin)).json()
        ids = {t["name"]: t["id"] for t in (tenants["data"] if isinstance(tenants, dict) else tenants)}
        keys = {}
        for name in ("acme", "other", "narrow"):
            created = await client.post(
                f"/admin/tenants/{ids[name]}/keys", json={"name": "test"}, headers=admin
            )
            assert created.status_code == 201, created.text
            keys[name] = created.json()["key"]
        # The live views the admin API serves come from this backend.
        queues = (await client.get("/admin/queues", headers=admin)).json()
        assert "classes" in json.dumps(queues)
        sdk = {
            name: openai.AsyncOpenAI(
                api_key=key, base_url="http://sluice.test/v1", http_client=client, max_retries=0
            )
            for name, key in keys.items()
        }
        yield sdk, backend


async def wait_done(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 120.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status}: {batch.request_counts}")
        await asyncio.sleep(0.2)


async def test_batch_runs_every_line_exactly_once(gateway) -> None:
    sdk, backend = gateway
    acme = sdk["acme"]
    uploaded = await acme.files.create(file=("in.jsonl", jsonl(12)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    assert (await acme.files.retrieve(uploaded.id)).id == uploaded.id
    batch = await acme.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status in ("in_progress", "completed")  # every line durably queued already
    assert batch.request_counts.total == 12
    done = await wait_done(acme, batch.id)
    assert done.status == "completed"
    assert done.request_counts.completed == 12 and done.request_counts.failed == 0
    assert done.metadata == {"job": "nightly"}
    content = (await acme.files.content(done.output_file_id)).content
    rows = [json.loads(line) for line in content.decode().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"c{i}" for i in range(12))
    assert all(r["response"]["status_code"] == 200 for r in rows)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] <= 4 for r in rows)
    assert all(0 <= r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
               <= r["response"]["body"]["usage"]["prompt_tokens"] for r in rows)
    assert done.error_file_id is None
    # Another tenant sees none of it.
    other = sdk["other"]
    for call in (
        other.batches.retrieve(batch.id),
        other.files.retrieve(uploaded.id),
        other.files.content(done.output_file_id),
        other.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            await call
    listed = await acme.batches.list(limit=5)
    assert [b.id for b in listed.data] == [batch.id]
    assert (await other.batches.list()).data == []
    assert backend.dispatcher.num_jobs == 0


async def test_batch_usage_reports_cached_prompt_tokens(gateway) -> None:
    sdk, _ = gateway
    acme = sdk["acme"]
    messages = [{"role": "user", "content": "A long shared instruction for every line of the job. " * 4}]
    warm = await acme.chat.completions.create(model="demo", messages=messages, max_tokens=2, temperature=0)
    assert warm.usage.prompt_tokens >= 32  # at least two full KV blocks to reuse
    body = {"model": "demo", "max_tokens": 2, "temperature": 0, "messages": messages}
    line = {"method": "POST", "url": "/v1/chat/completions", "body": body}
    lines = "".join(json.dumps({"custom_id": f"c{i}", **line}) + "\n" for i in range(2)).encode()
    uploaded = await acme.files.create(file=("in.jsonl", lines), purpose="batch")
    batch = await acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
    done = await wait_done(acme, batch.id)
    rows = [json.loads(line) for line in (await acme.files.content(done.output_file_id)).content.splitlines()]
    usages = [r["response"]["body"]["usage"] for r in rows]
    # The warm-up request's full blocks are in this tenant's prefix cache on the only worker.
    assert [u["prompt_tokens_details"]["cached_tokens"] >= 16 for u in usages] == [True, True]


async def test_bad_file_lists_bad_lines(gateway) -> None:
    sdk, _ = gateway
    bad = (
        jsonl(3) + b'{"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions", "body": {}}\nnope\n'
    )
    with pytest.raises(openai.BadRequestError) as info:
        await sdk["acme"].files.create(file=("bad.jsonl", bad), purpose="batch")
    message = str(info.value)
    assert "line 4" in message and "line 5" in message


async def test_cancel_ends_the_batch_with_each_line_answered_once(gateway) -> None:
    sdk, _ = gateway
    acme = sdk["acme"]
    uploaded = await acme.files.create(
        file=("in.jsonl", jsonl(30, url="/v1/completions", max_tokens=64)), purpose="batch"
    )
    batch = await acme.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    cancelled = await acme.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    done = await wait_done(acme, batch.id)
    assert done.status == "cancelled"
    ids: list[str] = []
    for file_id in (done.output_file_id, done.error_file_id):
        if file_id:
            ids += [
                json.loads(x)["custom_id"]
                for x in (await acme.files.content(file_id)).content.decode().split("\n")
                if x
            ]
    assert sorted(ids) == sorted(f"c{i}" for i in range(30))
    assert done.request_counts.completed + done.request_counts.failed == 30


async def test_lines_over_a_rate_limit_wait_instead_of_failing(gateway) -> None:
    sdk, backend = gateway
    narrow = sdk["narrow"]  # at most 2 requests in flight: the other lines are deferred, not failed
    uploaded = await narrow.files.create(file=("in.jsonl", jsonl(6, max_tokens=8)), purpose="batch")
    batch = await narrow.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    done = await wait_done(narrow, batch.id)
    assert done.status == "completed"
    assert done.request_counts.completed == 6 and done.request_counts.failed == 0
    assert backend.batch_lines.deferrals_total > 0
    # A deferred copy of a line that another delivery already answered (the queue keeper re-enqueues
    # lines it does not see held) ends at its retry, as a skipped duplicate: none stays behind.
    for _ in range(240):
        if backend.batch_lines.deferred == 0:
            break
        await asyncio.sleep(0.5)
    assert backend.batch_lines.deferred == 0
    assert (await narrow.batches.retrieve(batch.id)).request_counts.completed == 6


async def test_lines_left_after_the_completion_window_expire_the_batch(gateway, database_url: str) -> None:
    """Lines that have not run when the window closes are answered `batch_expired`, each exactly
    once; the batch ends `expired` (OpenAI semantics), with the lines that did run in its output."""
    import datetime as dt

    from sqlalchemy import update

    from sluice.gateway.batches.models import Batch
    from sluice.gateway.db.session import make_engine

    sdk, _ = gateway
    narrow = sdk["narrow"]  # two lines in flight at a time: most are still waiting when it expires
    uploaded = await narrow.files.create(file=("in.jsonl", jsonl(16, max_tokens=48)), purpose="batch")
    batch = await narrow.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    # The window closes now: the 24 hours pass in the database, not in the test.
    engine = make_engine(database_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(update(Batch).where(Batch.id == batch.id)
                               .values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)))
    finally:
        await engine.dispose()
    done = await wait_done(narrow, batch.id)
    assert done.status == "expired" and done.expired_at is not None
    assert done.request_counts.failed >= 1
    assert done.request_counts.completed + done.request_counts.failed == 16
    rows = []
    for file_id in (done.output_file_id, done.error_file_id):
        if file_id:
            rows += [json.loads(x) for x in (await narrow.files.content(file_id)).content.decode().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"c{i}" for i in range(16))
    expired = [r for r in rows if r["error"] is not None]
    assert len(expired) == done.request_counts.failed
    assert all(r["error"]["code"] == "batch_expired" for r in expired)
