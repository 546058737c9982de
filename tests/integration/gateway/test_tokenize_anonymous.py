"""`[gateway] anonymous_tokenize`: /tokenize and /detokenize without a key, the way vLLM serves
them (and `vllm bench serve` calls them); a key still scopes them, and /v1 stays closed."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from sluice.gateway.app import create_app
from sluice.gateway.queueing.local import LocalEngineBackend
from sluice.settings import AdminSettings, DatabaseSettings, GatewaySettings, Settings

pytestmark = pytest.mark.integration


async def test_anonymous_tokenize_when_enabled(demo_model_dir: Path, tmp_path: Path) -> None:
    admin_token = "slc-admin-" + secrets.token_urlsafe(32)
    settings = Settings(gateway=GatewaySettings(anonymous_tokenize=True), admin=AdminSettings(token=admin_token),
                        database=DatabaseSettings(url=f"sqlite+aiosqlite:///{tmp_path / 'sluice.db'}"))
    backend = LocalEngineBackend({"demo": demo_model_dir}, {"max_num_seqs": 2, "kv_cache_bytes": 8 * 2**20})
    async with AsyncTestClient(create_app(settings, backend), base_url="http://sluice.test") as client:
        # The exact calls of vllm bench serve's prompt alignment: no Authorization header.
        tokens = await client.post("/tokenize", json={"model": "demo", "prompt": "Once upon a time",
                                                      "add_special_tokens": False})
        assert tokens.status_code == 200, tokens.text
        ids = tokens.json()["tokens"]
        back = await client.post("/detokenize", json={"model": "demo", "tokens": ids})
        assert back.json() == {"prompt": "Once upon a time"}
        missing = await client.post("/tokenize", json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        # A header that is there but wrong is still refused; /v1 still needs a key.
        wrong = await client.post("/tokenize", json={"prompt": "x"}, headers={"authorization": "Bearer sk-slc-no"})
        assert wrong.status_code == 401
        assert (await client.post("/v1/completions", json={"model": "demo", "prompt": "x"})).status_code == 401
        admin = {"authorization": f"Bearer {admin_token}"}
        tenant = (await client.post("/admin/tenants", json={"name": "narrow", "allowed_models": ["other"]},
                                    headers=admin)).json()
        key = (await client.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": "k"}, headers=admin)).json()
        scoped = await client.post("/tokenize", json={"model": "demo", "prompt": "x"},
                                   headers={"authorization": f"Bearer {key['key']}"})
        assert scoped.status_code == 403  # with a key, the tenant's scope applies
