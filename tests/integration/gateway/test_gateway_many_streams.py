"""Many concurrent SSE streams through one gateway: every one completes with usage, none errors."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STREAMS = int(os.environ.get("SLUICE_TEST_STREAMS", "64"))


def test_concurrent_streams_complete(gateway) -> None:
    tenant, key = gateway.tenant()

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": f"story {i}"}],
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        completion = -1
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith('data: {"id"') and '"usage":{' in line:
                    completion = int(line.split('"completion_tokens":')[1].split(",")[0])
                assert '"error"' not in line
        return completion

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=STREAMS + 4)
        async with httpx.AsyncClient(
            base_url=gateway.base_url, limits=limits, timeout=120, headers={"authorization": f"Bearer {key}"}
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(STREAMS)))

    assert asyncio.run(main()) == [8] * STREAMS
    with gateway.admin() as admin:
        end = time.monotonic() + 60
        while True:
            rows = admin.get("/admin/usage", params={"tenant_id": tenant["id"]}).json()["data"]
            if rows and rows[0]["requests"] == STREAMS:
                break
            assert time.monotonic() < end, rows
            time.sleep(0.1)
        assert rows[0]["completion_tokens"] == 8 * STREAMS
