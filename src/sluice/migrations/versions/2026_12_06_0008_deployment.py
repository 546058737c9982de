"""The deployment's id: deployment (one row, made by the first gateway that starts).

Replicas on one database share it; it is written under the Redis prefix at start, so a gateway of
another deployment on the same Redis and prefix refuses to start (docs/scale-out.md).

Revision ID: 0008_deployment
Revises: 0007_tenant_predicted_miss
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_deployment"
down_revision = "0007_tenant_predicted_miss"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deployment",
        sa.Column("row", sa.Integer(), nullable=False),
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("row", name="pk_deployment"),
    )


def downgrade() -> None:
    op.drop_table("deployment")
