"""The replica that creates a batch: batch.created_by.

With several gateway replicas, a batch still `validating` (its lines being queued) belongs to the
replica creating it; another replica's start-up recovery fails it only when that replica is dead.
Rows from before this revision have no creator (one gateway made them) and are treated as dead.

Revision ID: 0004_batch_creator
Revises: 0003_console_sessions
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_batch_creator"
down_revision = "0003_console_sessions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batch", sa.Column("created_by", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batch") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("created_by")
