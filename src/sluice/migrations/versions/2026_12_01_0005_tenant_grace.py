"""A tenant's own disconnect grace: tenant.disconnect_grace_s.

How long a stream whose client went away waits for a re-attach before it is aborted
(docs/streams.md, "Disconnects: the grace window"). NULL, the value of every row from before this
revision, means the gateway's `gateway.disconnect_grace_s`.

Revision ID: 0005_tenant_grace
Revises: 0004_batch_creator
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_tenant_grace"
down_revision = "0004_batch_creator"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenant", sa.Column("disconnect_grace_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenant") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("disconnect_grace_s")
