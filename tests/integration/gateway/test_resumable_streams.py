"""Resumable SSE (docs/streams.md) over real HTTP: event ids, attach with Last-Event-ID (GET and the
POST re-sent with its Idempotency-Key), the disconnect grace, and the reconnecting client, on the
real gateway with the demo model, with the log in-process and in Redis (skipped without
$SLUICE_TEST_REDIS_URL). A client disconnect is a real closed connection; a broken connection in
the helper's test is a real TCP proxy that cuts it mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sluice_testing import free_socket, serve_app

from sluice.client import _events, stream_chat
from sluice.gateway.app import create_app
from sluice.gateway.queueing.local import LocalEngineBackend
from sluice_lab.loadgen.client import ClientResult, RequestSpec, send_streaming

ENGINE_OPTIONS = {"max_num_seqs": 32, "kv_cache_bytes": 32 * 2**20, "max_num_batched_tokens": 512}

pytestmark = pytest.mark.integration

GRACE_S = 60.0  # the gateway's setting: long, so a test that sees an abort sooner saw the opt-out
CHAT = [{"role": "user", "content": "Tell me a long story about rivers."}]
RESUMABLE = {"x-sluice-resumable": "1"}  # events with ids (without it or a key: `data:` lines only)


@pytest.fixture(scope="module", params=["in-process", "redis"])
def shared_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def record_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("records") / "records.jsonl"


@pytest.fixture(scope="module")
def gateway_options(record_log: Path) -> dict[str, Any]:
    return {"disconnect_grace_s": GRACE_S, "stream_retention_s": 120.0, "record_log_path": str(record_log)}


def wait_for(predicate: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def chat(max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, **extra}


def events(response: httpx.Response) -> list[tuple[str, str]]:
    return list(_events(response.iter_lines()))


def sse(client: httpx.Client, method: str, url: str, **kwargs: Any) -> tuple[httpx.Response, list[tuple[str, str]]]:
    with client.stream(method, url, **kwargs) as response:
        return response, (events(response) if response.status_code == 200 else [])


def chat_text(items: list[tuple[str, str]]) -> str:
    out = []
    for _, data in items:
        if data != "[DONE]":
            chunk = json.loads(data)
            out.extend(c["delta"].get("content") or "" for c in chunk.get("choices", []))
    return "".join(out)


def reference(client: httpx.Client, body: dict[str, Any], path: str = "/v1/chat/completions") -> str:
    answer = client.post(path, json={**body, "stream": False})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def assert_consecutive(items: list[tuple[str, str]], response_id: str, first: int = 0) -> None:
    assert [i for i, _ in items] == [f"{response_id}:{s}" for s in range(first, first + len(items))]


def records(path: Path, request_id: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("request_id") == request_id]


# ---- event ids and replay ----------------------------------------------------------------------


def test_every_event_has_an_id_and_a_stale_last_event_id_replays_exactly_the_rest(gateway) -> None:
    _, key = gateway.tenant()
    with gateway.client(key) as client:
        body = chat(stream=True, stream_options={"include_usage": True})
        want = reference(client, chat())
        response, items = sse(client, "POST", "/v1/chat/completions", json=body, headers=RESUMABLE)
        assert response.status_code == 200
        response_id = json.loads(items[0][1])["id"]
        assert_consecutive(items, response_id)  # usage chunk and [DONE] included
        assert items[-1][1] == "[DONE]" and json.loads(items[-2][1])["usage"]["completion_tokens"] > 0
        assert chat_text(items) == want
        for k in (0, 3, len(items) - 3):
            _, rest = sse(
                client,
                "GET",
                f"/v1/chat/completions/{response_id}/events",
                headers={"last-event-id": f"{response_id}:{k}"},
            )
            assert rest == items[k + 1 :]  # byte for byte: no gap, no duplicate
            assert chat_text(items[: k + 1] + rest) == want
        _, whole = sse(client, "GET", f"/v1/chat/completions/{response_id}/events")  # no header: from the start
        assert whole == items


def test_completions_resume_and_the_idempotent_post(gateway) -> None:
    _, key = gateway.tenant()
    with gateway.client(key) as client:
        body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "stream": True}
        idem = {"idempotency-key": "order-42"}
        response, items = sse(client, "POST", "/v1/completions", json=body, headers=idem)
        assert response.status_code == 200
        response_id = json.loads(items[0][1])["id"]
        assert response_id.startswith("cmpl-")
        assert_consecutive(items, response_id)
        # The same POST, the same key: the same response (nothing new runs), from after Last-Event-ID.
        _, again = sse(
            client, "POST", "/v1/completions", json=body, headers={**idem, "last-event-id": f"{response_id}:2"}
        )
        assert again == items[3:]
        _, whole = sse(client, "POST", "/v1/completions", json=body, headers=idem)
        assert whole == items
        _, rest = sse(
            client, "GET", f"/v1/completions/{response_id}/events", headers={"last-event-id": f"{response_id}:1"}
        )
        assert rest == items[2:]
        # A resume whose key this tenant never used: 404, not a fresh start that would repeat events.
        gone = client.post(
            "/v1/completions", json=body, headers={"idempotency-key": "never", "last-event-id": f"{response_id}:1"}
        )
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "stream_not_found"


def test_disconnect_then_reattach_within_the_grace_gets_the_whole_text(gateway) -> None:
    _, key = gateway.tenant()
    with gateway.client(key) as client:
        body = chat(max_tokens=400, ignore_eos=True)
        want = reference(client, body)
        post = {"json": {**body, "stream": True}, "headers": RESUMABLE}
        with client.stream("POST", "/v1/chat/completions", **post) as response:
            seen = []
            for item in _events(response.iter_lines()):
                seen.append(item)
                if len(seen) == 5:
                    break
        # The connection is closed mid-stream: generation goes on into the log meanwhile.
        response_id = json.loads(seen[0][1])["id"]
        _, rest = sse(
            client, "GET", f"/v1/chat/completions/{response_id}/events", headers={"last-event-id": seen[-1][0]}
        )
        whole = seen + rest
        assert_consecutive(whole, response_id)
        assert whole[-1][1] == "[DONE]" and chat_text(whole) == want


def strict_events(response: httpx.Response) -> list[str]:
    """The payloads as a strict client reads them (vLLM's `bench serve`, many hand-written ones):
    every non-empty line must be `data: ...`, one per event; anything else is an error."""
    payloads = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), f"a strict SSE client cannot read {line!r}"
            payloads.append(line.removeprefix("data: "))
    return payloads


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_without_opting_in_every_event_is_one_data_line(gateway, path: str) -> None:
    _, key = gateway.tenant()
    prompt = {"messages": CHAT} if "chat" in path else {"prompt": "Once upon a time"}
    body = {"model": "demo", **prompt, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with gateway.client(key) as client:
        want = reference(client, {k: v for k, v in body.items() if k != "stream_options"}, path)
        for headers in ({}, {"x-sluice-resumable": "0", "idempotency-key": "strict-1"}):
            with client.stream("POST", path, json=body, headers=headers) as response:
                assert response.status_code == 200
                payloads = strict_events(response)
            assert payloads[-1] == "[DONE]"
            chunks = [json.loads(p) for p in payloads[:-1]]  # each one whole JSON document
            text = "".join(c.get("delta", {}).get("content") or c.get("text") or ""
                           for chunk in chunks for c in chunk["choices"])
            assert text == want and chunks[-1]["usage"]["completion_tokens"] > 0
        # Opting in (a header, or a key alone) adds the ids; the payloads are the same.
        for headers in (RESUMABLE, {"idempotency-key": "resumable-1"}):
            response, items = sse(client, "POST", path, json=body, headers=headers)
            response_id = json.loads(items[0][1])["id"]
            assert_consecutive(items, response_id)
        answer = client.post(path, json=body, headers={"x-sluice-resumable": "sometimes"})
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"


# ---- who may attach, and bad input --------------------------------------------------------------


def test_only_the_creating_tenant_attaches_and_garbage_is_a_4xx(gateway) -> None:
    _, key = gateway.tenant()
    _, other_key = gateway.tenant()
    with gateway.client(key) as client, gateway.client(other_key) as other:
        _, items = sse(
            client, "POST", "/v1/chat/completions", json=chat(8, stream=True), headers={"idempotency-key": "k1"}
        )
        response_id = json.loads(items[0][1])["id"]
        url = f"/v1/chat/completions/{response_id}/events"
        for answer in (
            other.get(url),
            other.get(url, headers={"last-event-id": f"{response_id}:0"}),
            client.get("/v1/chat/completions/chatcmpl-nosuchresponse/events"),
            client.get(f"/v1/completions/{response_id}/events"),  # a chat id on the completions route
        ):
            assert answer.status_code == 404, answer.text
            assert answer.json()["error"]["code"] == "stream_not_found"
        # The other tenant's same key is its own: it starts its own response.
        _, theirs = sse(
            other, "POST", "/v1/chat/completions", json=chat(8, stream=True), headers={"idempotency-key": "k1"}
        )
        assert json.loads(theirs[0][1])["id"] != response_id
        for headers in (
            {"last-event-id": "garbage"},
            {"last-event-id": f"{response_id}:x"},
            {"last-event-id": f"{response_id}:-1"},
            {"last-event-id": "chatcmpl-another:3"},
        ):
            answer = client.get(url, headers=headers)
            assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error", headers
        post = "/v1/chat/completions"
        for headers in (
            {"x-sluice-disconnect": "sometimes"},
            {"x-sluice-disconnect": "grace=-1"},
            {"idempotency-key": "x" * 300},
            {"last-event-id": f"{response_id}:1"},  # a resume without its key
            {"idempotency-key": "k1", "last-event-id": "chatcmpl-another:1"},
        ):
            answer = client.post(post, json=chat(4, stream=True), headers=headers)
            assert answer.status_code == 400 and "error" in answer.json(), headers


# ---- the disconnect grace -----------------------------------------------------------------------


def _start_and_drop(client: httpx.Client, body: dict[str, Any], headers: dict[str, str]) -> str:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as response:
        assert response.status_code == 200
        first = next(_events(response.iter_lines()))
    return str(json.loads(first[1])["id"])


def _ended_abandoned(client: httpx.Client, response_id: str, timeout: float) -> list[tuple[str, str]]:
    _, items = sse(client, "GET", f"/v1/chat/completions/{response_id}/events", timeout=timeout)
    return items


@pytest.mark.parametrize("disconnect", ["grace=1", "abort"])
def test_no_reattach_within_the_grace_aborts_and_releases_the_quota(gateway, record_log: Path, disconnect: str) -> None:
    _, key = gateway.tenant(quotas={"max_concurrent": 1})
    body = chat(max_tokens=3000, ignore_eos=True)
    with gateway.client(key) as client:
        response_id = _start_and_drop(client, body, {"x-sluice-disconnect": disconnect})
        # Aborted long before the 3000 tokens and before the gateway's 60 s grace: by this
        # request's own grace or opt-out. (Attaching meanwhile would hold it: not done here.)
        record = wait_for(lambda: records(record_log, response_id), "the aborted request's record", GRACE_S / 2)[0]
        assert record["finish_reason"] == "abort" and record["completion_tokens"] < 3000
        rest = _ended_abandoned(client, response_id, timeout=30)  # the log ends with the reason
        assert json.loads(rest[-1][1])["error"]["code"] == "stream_abandoned"
        # The concurrency hold was released: the tenant's one slot takes a new request.
        answer = wait_for(
            lambda: (a := client.post("/v1/chat/completions", json=chat(4))).status_code == 200 and a,
            "the concurrency hold to be released",
        )
        assert answer.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_tenant_grace_overrides_the_gateway_s_and_a_client_cannot_lengthen_it(gateway, record_log: Path) -> None:
    tenant, key = gateway.tenant(disconnect_grace_s=None)
    assert tenant["disconnect_grace_s"] is None  # the gateway's setting
    with gateway.admin() as admin:
        changed = admin.patch(f"/admin/tenants/{tenant['id']}", json={"disconnect_grace_s": 1})
        assert changed.status_code == 200 and changed.json()["disconnect_grace_s"] == 1, changed.text
        for bad in (-1, 3601, "soon"):
            refused = admin.patch(f"/admin/tenants/{tenant['id']}", json={"disconnect_grace_s": bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"], refused.text
    body = chat(max_tokens=3000, ignore_eos=True)
    with gateway.client(key) as client:
        for headers in ({}, {"x-sluice-disconnect": "grace=50"}):  # asking for more gets the tenant's 1 s
            response_id = _start_and_drop(client, body, headers)
            record = wait_for(lambda rid=response_id: records(record_log, rid), "the aborted request's record",
                              GRACE_S / 2)[0]
            assert record["finish_reason"] == "abort" and record["completion_tokens"] < 3000


def test_during_the_grace_the_request_runs_and_holds_its_concurrency(gateway) -> None:
    _, key = gateway.tenant(quotas={"max_concurrent": 1})
    body = chat(max_tokens=400, ignore_eos=True)
    with gateway.client(key) as client:
        want = reference(client, body)
        response_id = _start_and_drop(client, body, {})
        held = client.post("/v1/chat/completions", json=chat(4))
        assert held.status_code == 429  # the disconnected stream still holds the tenant's one slot
        _, items = sse(
            client, "GET", f"/v1/chat/completions/{response_id}/events", headers={"last-event-id": f"{response_id}:0"}
        )
        assert_consecutive(items, response_id, first=1)
        assert items[-1][1] == "[DONE]" and chat_text(items) == want  # seq 0, the role chunk, has no text


# ---- the reconnecting client -------------------------------------------------------------------


class CuttingProxy:
    """TCP proxy to the gateway that closes each of its first `cuts` connections after the
    server has sent `after_bytes` bytes: a real broken connection mid-stream."""

    def __init__(self, target: str, cuts: int, after_bytes: int) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.cuts = cuts
        self.after_bytes = after_bytes
        self.sock = free_socket()
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            cut = self.connections <= self.cuts
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(conn, upstream, None), daemon=True).start()
            threading.Thread(
                target=self._pipe, args=(upstream, conn, self.after_bytes if cut else None), daemon=True
            ).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(4096):
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[: max(limit - sent, 0)])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.sock.close()


def test_the_reconnecting_client_yields_each_event_once_over_broken_connections(gateway) -> None:
    _, key = gateway.tenant()
    body = chat(max_tokens=120, ignore_eos=True)
    with gateway.client(key) as client:
        want = reference(client, body)
    proxy = CuttingProxy(gateway.base_url, cuts=3, after_bytes=1500)
    try:
        got = list(stream_chat(proxy.url, key, body, backoff_s=0.05))
    finally:
        proxy.close()
    assert proxy.connections >= 4  # three cut, then one whole
    response_id = got[0].id.rpartition(":")[0]
    assert [e.id for e in got] == [f"{response_id}:{s}" for s in range(len(got))]
    text = "".join(c["delta"].get("content") or "" for e in got for c in e.data["choices"])
    assert text == want


def test_the_load_generator_reattaches_broken_streams_and_times_them_as_one(gateway) -> None:
    """`sluice bench serve --reconnects`: the load generator's request survives cut connections."""
    _, key = gateway.tenant()
    spec = RequestSpec(local_id="lg-1", workload="chat", tenant="t", api_key=key, prompt=CHAT[0]["content"],
                       max_tokens=120, service_tier=None, ignore_eos=True, temperature=0.0)
    proxy = CuttingProxy(gateway.base_url, cuts=3, after_bytes=1500)

    async def send(url: str, reconnects: int) -> ClientResult:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await send_streaming(client, spec, model="demo", endpoint="chat", reconnects=reconnects)

    undisturbed = asyncio.run(send(gateway.base_url, 0))
    try:
        cut = asyncio.run(send(proxy.url, 0))  # no re-attach: a cut stream is an error, not a short success
        whole = asyncio.run(send(proxy.url, 5))
    finally:
        proxy.close()
    assert undisturbed.ok and undisturbed.reconnects == 0 and undisturbed.completion_tokens == 120
    assert cut.error == "stream" and cut.reconnects == 0
    assert whole.ok, whole.error_detail
    assert whole.reconnects == 2  # the other two of the proxy's three cuts
    assert whole.completion_tokens == 120  # usage from the server's final chunk
    # Every text chunk once: as many as that response's own log holds. (Not the undisturbed run's
    # count: the engine's drafts learn from earlier requests, so the same greedy text may come in
    # chunks of other sizes the next time.)
    with gateway.client(key) as client:
        _, logged = sse(client, "GET", f"/v1/chat/completions/{whole.request_id}/events")  # from the start
    text_chunks = [data for _, data in logged if data != "[DONE]" and chat_text([("", data)])]
    assert len(whole.token_times) == len(text_chunks) > 0
    assert whole.finish_reason == "length" and whole.first_token is not None


# ---- two replicas on one Redis -----------------------------------------------------------------


@pytest.fixture(scope="module")
def replica_b(gateway, demo_model_dir: Path, shared_mode: str) -> Iterator[str]:
    """A second gateway on the same database and Redis prefix (Redis mode only)."""
    if shared_mode != "redis":
        pytest.skip("two replicas need the shared store")
    app = create_app(gateway.app.state.services.settings, LocalEngineBackend({"demo": demo_model_dir}, ENGINE_OPTIONS))
    with serve_app(app) as base_url:
        yield base_url


def test_a_stream_accepted_on_a_is_followed_through_b_while_it_runs(gateway, replica_b: str) -> None:
    _, key = gateway.tenant()
    _, other_key = gateway.tenant()
    body = chat(max_tokens=600, ignore_eos=True)
    with gateway.client(key) as client:
        want = reference(client, body)
        # A 1 s grace on A: B's follower must hold it off (a follower on another replica counts).
        response_id = _start_and_drop(client, body, {"x-sluice-disconnect": "grace=1"})
    headers = {"authorization": f"Bearer {key}", "last-event-id": f"{response_id}:0"}
    with httpx.Client(base_url=replica_b, timeout=120) as b:
        assert (
            b.get(
                f"/v1/chat/completions/{response_id}/events", headers={"authorization": f"Bearer {other_key}"}
            ).status_code
            == 404
        )
        with b.stream("GET", f"/v1/chat/completions/{response_id}/events", headers=headers) as response:
            assert response.status_code == 200
            items = events(response)
        assert_consecutive(items, response_id, first=1)
        assert items[-1][1] == "[DONE]" and chat_text(items) == want
        # After the end, from Redis (B never had it in memory): exactly the events after seq 5.
        with b.stream(
            "GET",
            f"/v1/chat/completions/{response_id}/events",
            headers={**headers, "last-event-id": f"{response_id}:5"},
        ) as response:
            assert events(response) == items[5:]
