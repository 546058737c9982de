"""Deadlines: `gateway.request_timeout_s` bounds a request from its acceptance to its end (waiting
for a worker and running on it). A request that outlives it is stopped at its worker, its quota
reservation is released, and the client gets an OpenAI-style error: a 504 answer when nothing was
sent yet, an error event when the stream had started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dispatch.conftest import WORKER_SECRET, wait_for

from sluice.settings import GatewaySettings

from .conftest import fault_settings, open_gateway

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Far shorter than generating 4,000 tokens on a CPU worker (400 were not enough once speculative
# decoding made the demo model's repetitive output several tokens per step).
TIMEOUT_S = 0.5
MAX_TOKENS = 4000


async def test_a_request_past_its_deadline_is_stopped_and_released(
        bootstrap_servers: str, demo_model_dir: Path, database_url: str, worker_port: int, worker: Any) -> None:
    settings = fault_settings(
        bootstrap_servers, demo_model_dir, database_url,
        gateway=GatewaySettings(worker_port=0, worker_secret=WORKER_SECRET, request_timeout_s=TIMEOUT_S),
    )
    async for gw in open_gateway(settings, worker_port):
        auth = {"authorization": f"Bearer {gw.sdk.api_key}"}
        long = {"model": "demo", "prompt": "hello", "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}

        whole = await gw.client.post("/v1/completions", json=long, headers=auth, timeout=120)
        assert whole.status_code == 504, whole.text
        error = whole.json()["error"]
        assert error["code"] == "request_timeout" and error["type"] == "timeout"
        assert set(error) == {"message", "type", "param", "code"}

        streamed = await gw.client.post("/v1/completions", json={**long, "stream": True}, headers=auth, timeout=120)
        if streamed.status_code == 200:  # the first token came in time: an error event ends the stream
            events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
            assert events[-1]["error"]["code"] == "request_timeout"
            assert "[DONE]" not in streamed.text
        else:
            assert streamed.status_code == 504 and streamed.json()["error"]["code"] == "request_timeout"

        # Released: nothing is reserved for the tenant, nothing is left at the dispatcher.
        assert gw.app.state.services.quotas.live(gw.tenant_id) == (0, 0)
        await wait_for(lambda d=gw.backend.dispatcher: d.num_jobs == 0, 60, "the stopped requests to end")
