"""usage_applied: the requests whose usage usage_daily holds, so a stream's usage recorded twice
(by its replica, then by the replica that took the stream over) counts once.

Revision ID: 0009_usage_applied
Revises: 0008_deployment
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_usage_applied"
down_revision = "0008_deployment"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_applied",
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name="pk_usage_applied"),
    )
    op.create_index("ix_usage_applied_day", "usage_applied", ["day"])


def downgrade() -> None:
    op.drop_index("ix_usage_applied_day", table_name="usage_applied")
    op.drop_table("usage_applied")
