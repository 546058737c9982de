"""Admin console sessions: console_session.

Revision ID: 0003_console_sessions
Revises: 0002_batches
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_console_sessions"
down_revision = "0002_batches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_session",
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("hash", name="pk_console_session"),
    )
    op.create_index("ix_console_session_expires_at", "console_session", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_console_session_expires_at", table_name="console_session")
    op.drop_table("console_session")
