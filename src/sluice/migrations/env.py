"""Alembic environment: runs migrations over the async engine (aiosqlite or asyncpg).

The URL comes from the Config attribute `sqlalchemy.url` (set by sluice.gateway.db.migrate), or
`-x url=...` on the alembic command line, or SLUICE_DATABASE_URL.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection

from sluice.gateway.batches import models as _batch_models  # noqa: F401  (registers the Batch API's tables)
from sluice.gateway.db import models as _models  # noqa: F401  (registers the tables)
from sluice.gateway.db.base import Base
from sluice.gateway.db.session import make_engine

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or context.get_x_argument(as_dictionary=True).get("url")
    url = url or os.environ.get("SLUICE_DATABASE_URL", "")
    if not url:
        raise ValueError("no database URL: pass -x url=... or set SLUICE_DATABASE_URL")
    return url


def _do_run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = make_engine(_url())
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_do_run)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async())
