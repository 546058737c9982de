"""Issue #36, resumable streams: an attach past the end of a finished stream returns at once on
every replica, as the in-process log does, and attaches count against requests/min (item 4); a
Last-Event-ID with non-ASCII digits is a 400, not a 500 (item 12); disabling a tenant or revoking
its last key stops its running streams on every replica (item 14).

A real gateway over HTTP (uvicorn), the demo model in-process, SQLite; in Redis mode a second
replica on the same database and Redis prefix reads what the first one streamed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sluice_testing import serve_app

from sluice.gateway.app import create_app
from sluice.gateway.queueing.local import LocalEngineBackend

ENGINE_OPTIONS = {"max_num_seqs": 32, "kv_cache_bytes": 32 * 2**20, "max_num_batched_tokens": 512}

pytestmark = pytest.mark.integration

BODY = {"model": "demo", "messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": 8,
        "temperature": 0, "stream": True}


@pytest.fixture(scope="module", params=["in-process", "redis"])
def shared_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def other_replica(gateway: Any, demo_model_dir: Path, shared_mode: str) -> Iterator[str]:
    """Redis mode: a second gateway on the same database and Redis prefix; in-process: the same one."""
    if shared_mode != "redis":
        yield gateway.base_url
        return
    app = create_app(gateway.app.state.services.settings, LocalEngineBackend({"demo": demo_model_dir}, ENGINE_OPTIONS))
    with serve_app(app) as base_url:
        yield base_url


def _finished_stream(client: httpx.Client) -> tuple[str, int]:
    """A streamed chat read to its end: (response id, seq of its last event)."""
    ids = []
    # ids only for a client that opts in to resuming (docs/streams.md)
    with client.stream("POST", "/v1/chat/completions", json=BODY, headers={"x-sluice-resumable": "1"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("id: "):
                ids.append(line[4:])
    response_id, _, last = ids[-1].rpartition(":")
    return response_id, int(last)


def _attach(base: str, key: str, response_id: str, last_event_id: str) -> tuple[int, list[str]]:
    headers = {"authorization": f"Bearer {key}", "last-event-id": last_event_id}
    # 30 s is the failure mode (the attach waited for entries that never come), not a limit measured
    with httpx.Client(base_url=base, timeout=30) as client, client.stream(
            "GET", f"/v1/chat/completions/{response_id}/events", headers=headers) as response:
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        return response.status_code, data


def test_an_attach_past_the_end_returns_at_once_on_any_replica(gateway: Any, other_replica: str) -> None:
    _, key = gateway.tenant()
    with gateway.client(key) as client:
        response_id, last = _finished_stream(client)
    # Its last event, after the last event, far after it: an empty, ended answer each time.
    for after in (last, last + 1, last + 1000):
        status, data = _attach(other_replica, key, response_id, f"{response_id}:{after}")
        assert status == 200 and data == [], (after, data)
    status, data = _attach(other_replica, key, response_id, f"{response_id}:{last - 1}")
    assert status == 200 and data == ["[DONE]"]


def test_attaches_count_against_requests_per_minute(gateway: Any, other_replica: str) -> None:
    _, key = gateway.tenant(quotas={"requests_per_minute": 3})
    with gateway.client(key) as client:
        response_id, last = _finished_stream(client)  # request 1
    for _ in range(2):  # requests 2 and 3
        assert _attach(gateway.base_url, key, response_id, f"{response_id}:{last - 1}")[0] == 200
    with httpx.Client(base_url=other_replica, timeout=30, headers={"authorization": f"Bearer {key}"}) as client:
        refused = client.get(f"/v1/chat/completions/{response_id}/events")
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in refused.headers


@pytest.mark.parametrize("seq", ["\u00b2", "1\u00b9", "-1", "1e3", "99999999999999"])
def test_a_last_event_id_with_odd_digits_is_a_400(gateway: Any, seq: str) -> None:
    _, key = gateway.tenant()
    with gateway.client(key) as client:
        response_id, _ = _finished_stream(client)
        header = f"{response_id}:{seq}".encode("latin-1")  # a header's bytes are read as Latin-1
        answer = client.get(f"/v1/chat/completions/{response_id}/events", headers={"last-event-id": header})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "invalid_request_error"
        again = client.post("/v1/chat/completions", json=BODY,
                            headers={"idempotency-key": "k-" + response_id, "last-event-id": header})
        assert again.status_code == 400, again.text
        assert json.loads(again.text)["error"]["message"].startswith("Last-Event-ID")


def test_an_idempotency_key_replays_only_its_own_request(gateway: Any, other_replica: str) -> None:
    """Item 13: a key reused with another body or on the other endpoint is a 422, on any replica."""
    _, key = gateway.tenant()
    idem = {"idempotency-key": "order-42"}
    with gateway.client(key) as client, client.stream("POST", "/v1/chat/completions", json=BODY,
                                                     headers=idem) as response:
        first = [line for line in response.iter_lines() if line.startswith("data: ")]
    with httpx.Client(base_url=other_replica, timeout=30, headers={"authorization": f"Bearer {key}"}) as client:
        other_body = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 9}, headers=idem)
        assert other_body.status_code == 422, other_body.text
        assert other_body.json()["error"]["code"] == "idempotency_key_reused"
        other_endpoint = client.post("/v1/completions", json={"model": "demo", "prompt": "Tell me about rivers.",
                                                              "max_tokens": 8, "stream": True}, headers=idem)
        assert other_endpoint.status_code == 422, other_endpoint.text
        with client.stream("POST", "/v1/chat/completions", json=BODY, headers=idem) as response:
            assert response.status_code == 200
            again = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert again == first  # the same request: the first response replayed


def _stopped_stream(gateway: Any, base: str, key: str, stop: Callable[[httpx.Client], None]) -> list[str]:
    """The data events of a long stream on `base`, `stop(admin client)` called after its third event."""
    body = {**BODY, "max_tokens": 3000, "ignore_eos": True}
    data: list[str] = []
    with httpx.Client(base_url=base, timeout=60, headers={"authorization": f"Bearer {key}"}) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data.append(line[6:])
            if len(data) == 3:
                with gateway.admin() as admin:
                    stop(admin)
    assert len(data) < 3000  # stopped, not finished
    return data


def test_disabling_a_tenant_stops_its_running_streams(gateway: Any, other_replica: str) -> None:
    """Item 14: a disabled tenant's running stream ends at once with a `tenant_disabled` error event
    (decided: stop, not finish), and its key stops working. In Redis mode the stream runs on the
    other replica: the stop reaches it through the invalidation bus."""
    tenant, key = gateway.tenant()

    def disable(admin: httpx.Client) -> None:
        assert admin.patch(f"/admin/tenants/{tenant['id']}", json={"enabled": False}).status_code == 200

    data = _stopped_stream(gateway, other_replica, key, disable)
    assert json.loads(data[-1])["error"]["code"] == "tenant_disabled", data[-2:]
    with gateway.client(key) as client:
        assert client.get("/v1/models").status_code in (401, 403)


def test_revoking_a_tenants_last_key_stops_its_running_streams(gateway: Any, other_replica: str) -> None:
    """Item 14: with its last key revoked nothing can authenticate as the tenant: its streams end
    (`key_revoked`), on every replica. Revoking one of two keys stops nothing."""
    tenant, key = gateway.tenant()
    with gateway.admin() as admin:
        spare = admin.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": "spare"})
        assert spare.status_code == 201, spare.text
        keys = admin.get(f"/admin/tenants/{tenant['id']}/keys").json()
    key_ids = [k["id"] for k in (keys["data"] if isinstance(keys, dict) else keys)]
    assert len(key_ids) == 2

    def revoke(key_id: str) -> Callable[[httpx.Client], None]:
        def call(admin: httpx.Client) -> None:
            assert admin.delete(f"/admin/tenants/{tenant['id']}/keys/{key_id}").status_code == 200
        return call

    body = {**BODY, "max_tokens": 40, "ignore_eos": True}
    with httpx.Client(base_url=other_replica, timeout=60, headers={"authorization": f"Bearer {key}"}) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as answer, gateway.admin() as admin:
        revoke(spare.json()["id"])(admin)  # one of two: the running stream goes on to its end
        data = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-2:]
    data = _stopped_stream(gateway, other_replica, key, revoke(next(k for k in key_ids if k != spare.json()["id"])))
    assert json.loads(data[-1])["error"]["code"] == "key_revoked", data[-2:]
