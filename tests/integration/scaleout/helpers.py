"""What the scale-out tests share: HTTP calls spread over replicas, and the worker-side view of
when each request ran (from the replicas' per-request records)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import httpx

from sluice.telemetry import RequestRecord
from sluice_lab.experiments.cluster import Cluster

COMPLETION = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def complete(client: httpx.AsyncClient, cluster: Cluster, replica: int, key: str,
                   **body: Any) -> httpx.Response:
    return await client.post(f"{cluster.replicas[replica].base_url}/v1/completions",
                             json={**COMPLETION, **body}, headers=auth(key))


def engine_interval(record: RequestRecord) -> tuple[float, float] | None:
    """(first scheduled, last token) on the worker's engine clock, or None when it never ran.

    The last token is the first token plus the stream's inter-token gaps (the record keeps their
    mean over completion_tokens - 1 gaps). Both ends lie inside the request's quota hold: the hold
    starts at admission, before dispatch, and ends at settlement, after the final token arrived."""
    start, first = record.engine_first_scheduled, record.engine_first_token
    if start is None or first is None:
        return None
    gaps = max(0, record.completion_tokens - 1)
    return start, first + (record.itl_mean_s or 0.0) * gaps


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at t closes before a start at t)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                    key=lambda event: (event[0], event[1]))
    best = current = 0
    for _, change in events:
        current += change
        best = max(best, current)
    return best


async def until(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.05) -> float:
    """Seconds until `await predicate()` is true; fails after timeout_s."""
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(interval_s)
    return time.monotonic() - start


def records_for(cluster: Cluster, tenant_name: str) -> list[RequestRecord]:
    return [r for r in cluster.records() if r.tenant == tenant_name]


async def wait_records(cluster: Cluster, tenant_name: str, count: int, timeout_s: float = 30.0) -> list[RequestRecord]:
    """A request's record is written just after its answer; wait until `count` are there."""
    async def enough() -> bool:
        return len(records_for(cluster, tenant_name)) >= count

    await until(enough, timeout_s, f"{count} records of {tenant_name}", interval_s=0.2)
    return records_for(cluster, tenant_name)
