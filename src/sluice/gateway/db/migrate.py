"""Runs the Alembic migrations (the only way the schema is created or changed)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config

import sluice
from sluice.gateway.db.session import normalize_url

# sluice/migrations links to the repository's migrations/ and is packaged with sluice, so this
# works from a checkout and from an installed wheel alike.
MIGRATIONS_DIR = Path(sluice.__file__).resolve().parent / "migrations"


def alembic_config(url: str) -> Config:
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # '%' is ConfigParser interpolation syntax; a password may contain it.
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Brings the database at `url` to `revision` (blocking; runs its own event loop)."""
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


async def migrate(url: str, revision: str = "head") -> None:
    """`upgrade` from async code: Alembic's env runs its own loop, so it runs in a thread."""
    await asyncio.to_thread(upgrade, url, revision)
