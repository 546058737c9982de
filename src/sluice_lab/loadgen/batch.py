"""A Batch API workload: upload a JSONL file, create a batch, poll until it ends.

Uses OpenAI's Batch API shape (`POST /v1/files` with purpose=batch, `POST /v1/batches`,
`GET /v1/batches/{id}`, `GET /v1/files/{id}/content`), so it runs against any server that
implements it. Reports completion time and throughput, not per-line latency (lines of a batch
have no client-visible timing).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import msgspec

from sluice_lab.loadgen.client import RequestSpec, build_body, endpoint_path
from sluice_lab.loadgen.scenario import Workload

_TERMINAL = {"completed", "failed", "expired", "cancelled"}


class BatchOutcome(msgspec.Struct, kw_only=True):
    workload: str
    tenant: str
    lines: int
    batch_id: str = ""
    status: str = ""
    submitted_at: float = 0.0
    finished_at: float = 0.0
    completion_s: float | None = None
    completed: int = 0
    failed: int = 0
    completion_tokens: int = 0
    lines_per_s: float | None = None
    tokens_per_s: float | None = None
    error: str = ""


def batch_jsonl(specs: list[RequestSpec], model: str, endpoint: str) -> bytes:
    lines = []
    for i, spec in enumerate(specs):
        body = build_body(spec, model, endpoint)
        body.pop("stream")
        body.pop("stream_options")
        lines.append(json.dumps({"custom_id": f"{spec.workload}-{i}", "method": "POST",
                                 "url": endpoint_path(endpoint), "body": body}))
    return ("\n".join(lines) + "\n").encode()


async def run_batch_workload(client: httpx.AsyncClient, workload: Workload,
                             make_spec: Callable[[Workload], RequestSpec], *, model: str, endpoint: str,
                             timeout_s: float) -> BatchOutcome:
    specs = [make_spec(workload) for _ in range(workload.batch_lines)]
    outcome = BatchOutcome(workload=workload.name, tenant=workload.tenant.name, lines=len(specs))
    headers = {"Authorization": f"Bearer {workload.tenant.api_key}"} if workload.tenant.api_key else {}
    try:
        outcome.submitted_at = time.time()
        upload = await client.post("/v1/files", headers=headers, data={"purpose": "batch"},
                                   files={"file": ("batch.jsonl", batch_jsonl(specs, model, endpoint),
                                                   "application/jsonl")})
        upload.raise_for_status()
        created = await client.post("/v1/batches", headers=headers, json={
            "input_file_id": upload.json()["id"], "endpoint": endpoint_path(endpoint),
            "completion_window": "24h"})
        created.raise_for_status()
        batch = created.json()
        outcome.batch_id = batch["id"]
        deadline = outcome.submitted_at + timeout_s
        while batch.get("status") not in _TERMINAL:
            if time.time() > deadline:
                outcome.error = f"timeout: batch still {batch.get('status')} after {timeout_s:.0f} s"
                break
            await asyncio.sleep(workload.batch_poll_s)
            polled = await client.get(f"/v1/batches/{outcome.batch_id}", headers=headers)
            polled.raise_for_status()
            batch = polled.json()
        outcome.finished_at = time.time()
        outcome.status = str(batch.get("status", ""))
        counts = batch.get("request_counts") or {}
        outcome.completed = int(counts.get("completed") or 0)
        outcome.failed = int(counts.get("failed") or 0)
        if outcome.status == "completed":
            outcome.completion_s = outcome.finished_at - outcome.submitted_at
            if batch.get("output_file_id"):
                content = await client.get(f"/v1/files/{batch['output_file_id']}/content", headers=headers)
                content.raise_for_status()
                for line in content.text.splitlines():
                    if line.strip():
                        response = json.loads(line).get("response") or {}
                        usage = (response.get("body") or {}).get("usage") or {}
                        outcome.completion_tokens += int(usage.get("completion_tokens") or 0)
            if outcome.completion_s > 0:
                outcome.lines_per_s = outcome.completed / outcome.completion_s
                outcome.tokens_per_s = outcome.completion_tokens / outcome.completion_s
    except httpx.HTTPStatusError as exc:
        outcome.error = f"http_{exc.response.status_code}: {exc.response.text[:200]}"
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
    return outcome
