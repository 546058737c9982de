"""The migrated schema and `Base.metadata` agree (SQLite and PostgreSQL)."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from sluice.gateway.batches import models as _batch_models  # noqa: F401
from sluice.gateway.db import models as _models  # noqa: F401
from sluice.gateway.db.base import Base
from sluice.gateway.db.migrate import migrate
from sluice.gateway.db.session import make_engine

pytestmark = pytest.mark.integration


async def test_migrations_match_models(database_url: str) -> None:
    await migrate(database_url)
    await migrate(database_url)  # idempotent
    engine = make_engine(database_url)
    try:
        async with engine.connect() as conn:

            def diff(sync_conn):  # type: ignore[no-untyped-def]
                ctx = MigrationContext.configure(sync_conn, opts={"compare_type": True})
                return compare_metadata(ctx, Base.metadata)

            differences = await conn.run_sync(diff)
    finally:
        await engine.dispose()
    assert differences == []
