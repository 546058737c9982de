"""Tables of the gateway: tenants, API keys, quotas, daily usage, audit log, admin token, console sessions,
the deployment id.

The schema is created ONLY by Alembic (migrations/versions); a test checks this module and the
migrated schema agree on SQLite and PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Date,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from sluice.gateway.db.base import Base, UTCDateTime, utcnow
from sluice.settings import QuotaSeed

# The seven limits, named once (the seed file's struct); the table, the admin schemas and the
# quota service spell the same names, which tests/unit/gateway/test_quota_fields.py holds together.
QUOTA_FIELDS: tuple[str, ...] = QuotaSeed.__struct_fields__


class Tenant(Base):
    __tablename__ = "tenant"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    description: Mapped[str] = mapped_column(Text, default="")
    priority_ceiling: Mapped[str] = mapped_column(String(16))  # interactive | standard | batch
    default_class: Mapped[str] = mapped_column(String(16))
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    allowed_models: Mapped[list[str]] = mapped_column(JSON, default=list)  # empty = every model
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    # How long a stream whose client went away waits for a re-attach; NULL = gateway.disconnect_grace_s.
    disconnect_grace_s: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    # Latency targets replacing the class's for its interactive and standard requests (sluice/objectives.py);
    # NULL = the class's target from [objectives].
    ttft_target_s: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    itl_target_s: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    # queue | shed: what a request predicted to miss its TTFT target at every worker gets (docs/objectives.md).
    on_predicted_miss: Mapped[str] = mapped_column(String(8), default="queue", server_default="queue")


class ApiKey(Base):
    __tablename__ = "api_key"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenant.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(32))  # visible part, e.g. sk-slc-ab12cd
    hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    name: Mapped[str] = mapped_column(String(100), default="")
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Quota(Base):
    """One row per tenant; NULL = unlimited."""

    __tablename__ = "quota"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenant.id", ondelete="CASCADE"), primary_key=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_per_day: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_concurrent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_queued: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_output_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)

    def limits(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in QUOTA_FIELDS}


class UsageDaily(Base):
    __tablename__ = "usage_daily"
    __table_args__ = (UniqueConstraint("tenant_id", "model", "day"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenant.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(200))
    day: Mapped[dt.date] = mapped_column(Date)  # UTC
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)


class UsageApplied(Base):
    """The requests (and choices) whose usage is in usage_daily: a replica that takes over a stream
    records its usage again, and this table makes the second record count nothing. Rows older than
    two days are deleted (a takeover happens within seconds of the loss)."""

    __tablename__ = "usage_applied"

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    day: Mapped[dt.date] = mapped_column(Date, index=True)  # UTC, when it was applied


class AuditLog(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(100))
    action: Mapped[str] = mapped_column(String(100))
    target: Mapped[str] = mapped_column(String(200))
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # never holds secrets


class AdminToken(Base):
    __tablename__ = "admin_token"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class ConsoleSession(Base):
    """A signed-in admin console session; only the SHA-256 of its cookie value is stored."""

    __tablename__ = "console_session"

    hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, index=True)


class Deployment(Base):
    """Who this database is: one random id, made at the first start (gateway/cluster/deployment.py).
    Replicas on one database share it; a deployment with another database has another."""

    __tablename__ = "deployment"

    row: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1: two first starts cannot both write
    id: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
