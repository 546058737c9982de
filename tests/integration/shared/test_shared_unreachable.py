"""A gateway whose Redis does not answer starts, and fails closed: admissions get a 503 OpenAI
error (never a 500, never an admission without the shared limits)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from sluice.gateway.app import create_app
from sluice.gateway.queueing.local import LocalEngineBackend
from sluice.settings import AdminSettings, DatabaseSettings, Settings, SharedSettings

pytestmark = pytest.mark.integration


async def test_unreachable_redis_is_a_503_for_admission(demo_model_dir: Path, tmp_path: Path) -> None:
    admin_token = "slc-admin-" + secrets.token_urlsafe(32)
    settings = Settings(
        admin=AdminSettings(token=admin_token, demo_tenant=""),
        database=DatabaseSettings(url=f"sqlite+aiosqlite:///{tmp_path / 'sluice.db'}"),
        shared=SharedSettings(url="redis://127.0.0.1:1/0", lease_s=1.0),  # nothing listens on port 1
    )
    backend = LocalEngineBackend({"demo": demo_model_dir}, {"max_num_seqs": 2, "kv_cache_bytes": 8 * 2**20})
    async with AsyncTestClient(create_app(settings, backend), base_url="http://sluice.test") as client:
        admin = {"authorization": f"Bearer {admin_token}"}
        tenant = (await client.post("/admin/tenants", json={"name": "t", "quotas": {"max_concurrent": 1}},
                                    headers=admin)).json()
        key = (await client.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": "k"}, headers=admin)).json()
        answer = await client.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 1},
                                   headers={"authorization": f"Bearer {key['key']}"})
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == "service_unavailable" and error["type"] == "server_error"
        assert answer.headers["retry-after"] == "1"
        assert "127.0.0.1" not in answer.text  # internals go to the operator's log, not the client
        # A streamed request is filed in the stream log (Redis) before admission: also a 503.
        streamed = await client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key['key']}"},
                                     json={"model": "demo", "stream": True, "max_tokens": 1,
                                           "messages": [{"role": "user", "content": "hi"}]})
        assert streamed.status_code == 503, streamed.text
        assert streamed.json()["error"]["code"] == "service_unavailable"
        attach = await client.get("/v1/chat/completions/chatcmpl-unknown/events",
                                  headers={"authorization": f"Bearer {key['key']}"})
        assert attach.status_code in (404, 503), attach.text
        readiness = await client.get("/ready")
        assert readiness.status_code == 503 and readiness.json()["checks"]["shared"] is False
