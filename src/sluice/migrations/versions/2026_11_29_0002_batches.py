"""Batch API: batch_file, batch, batch_result.

Revision ID: 0002_batches
Revises: 0001_initial
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_batches"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "batch_file",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        _ts("created_at", nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name="fk_batch_file_tenant_id_tenant",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_batch_file"),
    )
    op.create_index("ix_batch_file_tenant_id", "batch_file", ["tenant_id"])
    op.create_table(
        "batch",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        _ts("created_at", nullable=False),
        _ts("expires_at", nullable=False),
        _ts("in_progress_at"), _ts("finalizing_at"), _ts("completed_at"), _ts("failed_at"),
        _ts("expired_at"), _ts("cancelling_at"), _ts("cancelled_at"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenant.id"], name="fk_batch_tenant_id_tenant", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_batch"),
    )
    op.create_index("ix_batch_tenant_id", "batch", ["tenant_id"])
    op.create_index("ix_batch_status", "batch", ["status"])
    op.create_table(
        "batch_result",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("batch_id", sa.String(40), nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
        _ts("created_at", nullable=False),
        sa.ForeignKeyConstraint(["batch_id"], ["batch.id"], name="fk_batch_result_batch_id_batch",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_batch_result"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_result_batch_id_custom_id"),
    )
    op.create_index("ix_batch_result_batch_id_ok", "batch_result", ["batch_id", "ok"])


def downgrade() -> None:
    op.drop_index("ix_batch_result_batch_id_ok", table_name="batch_result")
    op.drop_table("batch_result")
    op.drop_index("ix_batch_status", table_name="batch")
    op.drop_index("ix_batch_tenant_id", table_name="batch")
    op.drop_table("batch")
    op.drop_index("ix_batch_file_tenant_id", table_name="batch_file")
    op.drop_table("batch_file")
