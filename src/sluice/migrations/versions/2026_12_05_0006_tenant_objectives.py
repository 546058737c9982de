"""A tenant's own latency targets: tenant.ttft_target_s and tenant.itl_target_s.

They replace the class's targets ([objectives] in sluice.toml) for the tenant's interactive and
standard requests (docs/objectives.md). NULL, the value of every row from before this revision,
means the class's target.

Revision ID: 0006_tenant_objectives
Revises: 0005_tenant_grace
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_tenant_objectives"
down_revision = "0005_tenant_grace"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenant", sa.Column("ttft_target_s", sa.Float(), nullable=True))
    op.add_column("tenant", sa.Column("itl_target_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenant") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("itl_target_s")
        batch.drop_column("ttft_target_s")
