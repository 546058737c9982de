"""No answer tells a client where the queue lives or what went wrong inside: with the broker
gone, chat, completion (streamed or not), batch creation and readiness answer 503 (or /ready's
booleans) without the broker's address, host name, port, "Kafka" or an exception's text; the
reason goes to the operator's log."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from sluice.broker import EmbeddedBroker

from .conftest import fault_settings, jsonl, open_gateway

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHAT = {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}


def internals(broker: EmbeddedBroker) -> list[str]:
    host, port = broker.bootstrap_servers.rsplit(":", 1)
    return [broker.bootstrap_servers, host, f":{port}", "localhost", "kafka", "Kafka", "Error(",
            "Exception", "Traceback", "errno"]


async def test_a_503_names_no_internal_address_or_exception(
        own_broker: EmbeddedBroker, demo_model_dir: Path, database_url: str, worker_port: int, worker: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.gateway")
    settings = fault_settings(own_broker.bootstrap_servers, demo_model_dir, database_url)
    async for gw in open_gateway(settings, worker_port):
        tenant = {"authorization": f"Bearer {gw.sdk.api_key}"}
        upload = await gw.client.post("/v1/files", headers=tenant, files={"file": ("in.jsonl", jsonl(3))},
                                      data={"purpose": "batch"})
        assert upload.status_code == 200, upload.text
        assert (await gw.client.post("/v1/chat/completions", json=CHAT, headers=tenant)).status_code == 200
        own_broker.stop()
        answers = [
            await gw.client.post("/v1/chat/completions", json=CHAT, headers=tenant),
            await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=tenant),
            await gw.client.post("/v1/completions", headers=tenant,
                                 json={"model": "demo", "prompt": "hi", "max_tokens": 4, "stream": True}),
            await gw.client.post("/v1/batches", headers=tenant, json={
                "input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}),
        ]
        for answer in answers:
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert error["code"] == "service_unavailable" and answer.headers["retry-after"] == "1"
            leaked = [word for word in internals(own_broker) if word in answer.text]
            assert not leaked, (leaked, answer.text)
        ready = await gw.client.get("/ready")
        assert ready.status_code == 503 and ready.json()["checks"]["broker"] is False
        assert not [word for word in internals(own_broker) if word in ready.text], ready.text
        own_broker.start()  # the gateway then stops as usual
    # The operator's log does say why.
    assert any(own_broker.bootstrap_servers in r.getMessage() for r in caplog.records)
