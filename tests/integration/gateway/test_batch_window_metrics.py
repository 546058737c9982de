"""The batch window gauges (gateway/batches/window.py) read the open batches from a real database
(SQLite and PostgreSQL): how many are open, their lines without a result, the least time left."""

from __future__ import annotations

import datetime as dt

import pytest

from sluice import telemetry
from sluice.gateway.admin.schemas import TenantCreate
from sluice.gateway.admin.service import AdminService
from sluice.gateway.auth.service import AuthService
from sluice.gateway.batches import window
from sluice.gateway.batches.models import Batch, BatchResult
from sluice.gateway.db.base import utcnow
from sluice.gateway.db.migrate import migrate
from sluice.gateway.db.session import make_engine, make_session_factory

pytestmark = pytest.mark.integration


def _batch(batch_id: str, tenant_id: str, status: str, total: int, left: dt.timedelta) -> Batch:
    now = utcnow()
    return Batch(id=batch_id, tenant_id=tenant_id, input_file_id="file-x", endpoint="/v1/chat/completions",
                 completion_window="24h", status=status, total=total, created_at=now, expires_at=now + left)


def _result(batch_id: str, line_no: int) -> BatchResult:
    return BatchResult(batch_id=batch_id, custom_id=f"r{line_no}", line_no=line_no, ok=True, line="{}",
                       created_at=utcnow())


async def test_open_batches_lines_left_and_the_earliest_window(database_url: str) -> None:
    await migrate(database_url)
    engine = make_engine(database_url)
    sessions = make_session_factory(engine)
    try:
        assert await window.measure(sessions) == window.WindowReport(0, 0, None)
        tenant = await AdminService(sessions, AuthService(sessions, cache_ttl_s=1.0)).create_tenant(
            TenantCreate(name="batcher"))
        async with sessions() as session, session.begin():
            session.add_all([
                _batch("batch-a", tenant.id, "in_progress", 10, dt.timedelta(hours=20)),
                _batch("batch-b", tenant.id, "validating", 5, dt.timedelta(hours=3)),
                _batch("batch-done", tenant.id, "completed", 100, dt.timedelta(hours=1)),  # closed: not counted
            ])
        async with sessions() as session, session.begin():
            session.add_all([_result("batch-a", i) for i in range(4)])
            session.add(_result("batch-done", 0))
        report = await window.measure(sessions)
        assert (report.open_batches, report.lines_remaining) == (2, 10 + 5 - 4)
        assert report.window_left_s is not None and 3 * 3600 - 60 < report.window_left_s <= 3 * 3600
        window.BATCH_WINDOW.publish(report)
        assert telemetry.REGISTRY.get_sample_value("sluice:batch_lines_remaining") == 11
        assert telemetry.REGISTRY.get_sample_value("sluice:batch_open") == 2
        window.BATCH_WINDOW.publish(window.WindowReport(0, 0, None))
        assert telemetry.REGISTRY.get_sample_value("sluice:batch_window_left_seconds") is None
    finally:
        await engine.dispose()
