"""Alembic revisions of the gateway database (packaged as sluice.migrations)."""
