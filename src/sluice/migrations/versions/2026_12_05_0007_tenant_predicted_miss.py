"""A tenant's answer to a request predicted to miss its TTFT target: tenant.on_predicted_miss.

`queue` (every row from before this revision, and the default) queues it anyway and returns the
prediction in a header; `shed` refuses it at once with a 429 (docs/objectives.md).

Revision ID: 0007_tenant_predicted_miss
Revises: 0006_tenant_objectives
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_tenant_predicted_miss"
down_revision = "0006_tenant_objectives"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenant", sa.Column("on_predicted_miss", sa.String(8), nullable=False, server_default="queue"))


def downgrade() -> None:
    with op.batch_alter_table("tenant") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("on_predicted_miss")
