"""JSON views of files and batches (OpenAI's shapes) and the per-line request ids."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sluice.gateway.batches.models import Batch, FileObject
from sluice.gateway.edge.errors import OpenAIError


def not_found(what: str, ident: str) -> OpenAIError:
    return OpenAIError(404, f"No {what} found with id '{ident}'.", code="not_found")


def _ts(value: dt.datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def file_view(row: FileObject) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.size_bytes,
        "created_at": _ts(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def batch_view(row: Batch, completed: int, failed: int) -> dict[str, Any]:
    errors = None
    if row.errors:
        errors = {"object": "list", "data": row.errors}
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": errors,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": _ts(row.created_at),
        "in_progress_at": _ts(row.in_progress_at),
        "expires_at": _ts(row.expires_at),
        "finalizing_at": _ts(row.finalizing_at),
        "completed_at": _ts(row.completed_at),
        "failed_at": _ts(row.failed_at),
        "expired_at": _ts(row.expired_at),
        "cancelling_at": _ts(row.cancelling_at),
        "cancelled_at": _ts(row.cancelled_at),
        "request_counts": {"total": row.total, "completed": completed, "failed": failed},
        "metadata": row.metadata_,
    }


def line_request_id(batch_id: str, line_no: int) -> str:
    """Deterministic per line (a replayed line keeps its id) and carries the line number."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line_no}"


def batch_of_request(request_id: str) -> str:
    """The batch id encoded by `line_request_id` (any other id gives a name no batch has)."""
    return "batch_" + request_id.removeprefix("batch_req_").rpartition("_")[0]


def line_number(request_id: str) -> int:
    """The input line number encoded by `line_request_id`."""
    return int(request_id.rsplit("_", 1)[1])


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
