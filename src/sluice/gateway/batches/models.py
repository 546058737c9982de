"""Batch API tables (on the gateway's `Base`): uploaded files, batches, and one result per line.

`batch_result` is unique on (batch_id, custom_id): a line replayed after a gateway crash finds
its result already stored and is skipped, so every custom_id is answered exactly once.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import JSON, Boolean, ForeignKey, Index, Integer, LargeBinary, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from sluice.gateway.db.base import Base, UTCDateTime


class FileObject(Base):
    __tablename__ = "batch_file"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(
        String(40), ForeignKey("tenant.id", ondelete="CASCADE"), index=True
    )
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output
    filename: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column("bytes", Integer)  # `bytes` in the API
    line_count: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    # Deferred: a listing must not load every file's content (up to max_body_bytes each); what
    # reads it asks for it (`undefer`), and a lazy load by mistake raises instead of blocking.
    content: Mapped[bytes] = mapped_column(LargeBinary, deferred=True, deferred_raiseload=True)


class Batch(Base):
    __tablename__ = "batch"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(
        String(40), ForeignKey("tenant.id", ondelete="CASCADE"), index=True
    )
    input_file_id: Mapped[str] = mapped_column(String(40))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    in_progress_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finalizing_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    completed_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    failed_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    expired_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancelling_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancelled_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # The gateway replica creating it: a batch still `validating` is failed at another replica's
    # start only once its creator is dead (None: created before replicas were recorded).
    created_by: Mapped[str | None] = mapped_column(String(128), nullable=True)


class BatchResult(Base):
    __tablename__ = "batch_result"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_result_batch_id_custom_id"),
        Index("ix_batch_result_batch_id_ok", "batch_id", "ok"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(String(40), ForeignKey("batch.id", ondelete="CASCADE"))
    custom_id: Mapped[str] = mapped_column(String(512))
    line_no: Mapped[int] = mapped_column(Integer)
    ok: Mapped[bool] = mapped_column(Boolean)
    line: Mapped[str] = mapped_column(Text)  # the output (or error) JSONL line, without newline
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
