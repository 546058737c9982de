"""Issue #36, "an upstream is not trusted blindly" (items 9 and 10): a front `sluice serve --workers 0`
(real broker, SQLite, and Redis for the shared state and stream log where $SLUICE_TEST_REDIS_URL is
set) in front of a misbehaving OpenAI-compatible server.

The upstream is a fake, in a thread of the test: the faults it shows (token ids over 2**32, a
number as text, 500 chunks for max_tokens 111, a reported usage of 10**9 tokens, a 3 MB SSE line)
are ones no real server can be made to send. Its behaviour is chosen by the request's max_tokens.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.broker import free_port

from .test_serve import Serve, serve_environment, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NORMAL, BAD_ID, TOO_MANY, NOT_TEXT, LONG_LINE, SLOW, FAILS = 7, 101, 111, 112, 113, 60, 500
SECRET = "UPSTREAM-SECRET-DETAIL internal-host-10.1.2.3"
REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "")


def chunk(text: Any, token_ids: list[Any] | None = None, finish: str | None = None,
           usage: dict[str, int] | None = None, logprobs: Any = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if logprobs is not None:
        choice["logprobs"] = logprobs
    event: dict[str, Any] = {"id": "cmpl-fake", "object": "text_completion", "choices": [choice]}
    if usage is not None:
        event["usage"] = usage
    return b"data: " + json.dumps(event).encode() + b"\n\n"


class _Misbehaving(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # the link's probe
        body = json.dumps({"object": "list", "data": [{"id": "demo", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompt_tokens = len(request["prompt"])
        scenario = request["max_tokens"]
        if scenario == FAILS:
            body = json.dumps({"error": {"message": SECRET}}).encode()
            self.send_response(500)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        out = self.wfile
        if scenario == BAD_ID:
            out.write(chunk("a", [5]) + chunk("b", [2**33]) + chunk("", [], "stop"))
        elif scenario == TOO_MANY:
            for _ in range(500):
                out.write(chunk("b", [6]))
            out.write(chunk("", [], "length", {"prompt_tokens": prompt_tokens, "completion_tokens": 10**9}))
        elif scenario == NOT_TEXT:
            out.write(chunk(123, [7]) + chunk({"x": 1}, [7], "stop"))
        elif scenario == SLOW:  # a token every 0.1 s: still running when its batch is cancelled
            try:
                for _ in range(SLOW):
                    out.write(chunk("s", [8]))
                    out.flush()
                    time.sleep(0.1)
            except OSError:
                return  # the gateway closed the stream (the line was aborted)
            out.write(chunk("", [], "length", {"prompt_tokens": prompt_tokens, "completion_tokens": SLOW}))
        elif scenario == LONG_LINE:  # one well-formed chunk on a 3 MB line: more than sluice buffers
            out.write(chunk("x" * (3 * 2**20), [5], "stop"))
        else:
            for _ in range(scenario):
                out.write(chunk("a", [5]))
            out.write(chunk("", [], "length", {"prompt_tokens": prompt_tokens, "completion_tokens": scenario}))
        out.write(b"data: [DONE]\n\n")
        out.flush()


@pytest.fixture(scope="module", params=["in-process", "redis"])
def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path,
          bootstrap_servers: str) -> Iterator[tuple[Serve, str]]:
    if request.param == "redis" and not REDIS_URL:
        pytest.skip("SLUICE_TEST_REDIS_URL is not set")
    shared = {"SLUICE_SHARED_URL": REDIS_URL, "SLUICE_SHARED_PREFIX": f"hard{time.monotonic_ns()}"}
    yield from front_of_fake(_Misbehaving, tmp_path_factory.mktemp("front"), demo_model_dir, bootstrap_servers,
                             env=shared if request.param == "redis" else None)


def front_of_fake(handler: type[BaseHTTPRequestHandler], root: Path, demo_model_dir: Path, bootstrap_servers: str,
                  *, kind: str = "openai", env: dict[str, str] | None = None) -> Iterator[tuple[Serve, str]]:
    """A front `sluice serve --workers 0` whose one upstream, "fake" of `kind`, is `handler` served
    in a thread of the test; (the front, a key of its tenant "demo-chat") until the test ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = write_config(root / "config", demo_model_dir, sluice_toml="[dispatch]\nheartbeat_interval_s = 0.5\n",
                          tenants_toml='[[tenants]]\nname = "demo-chat"\n')
    (config / "upstreams.toml").write_text(
        f'[[upstreams]]\nname = "fake"\nbase_url = "http://127.0.0.1:{server.server_address[1]}/v1"\n'
        f'models = ["demo"]\nkind = "{kind}"\nmax_concurrency = 8\nrequest_timeout_s = 60\n')
    serve = Serve(root, {**serve_environment(root, config, bootstrap_servers, "hard"), **(env or {})},
                  free_port(), "--workers", "0")
    try:
        serve.wait_ready()
        tenants = serve.admin("GET", "/admin/tenants").json()
        tenant_id = next(t["id"] for t in (tenants["data"] if isinstance(tenants, dict) else tenants)
                         if t["name"] == "demo-chat")
        key = serve.admin("POST", f"/admin/tenants/{tenant_id}/keys", json={"name": "t"}).json()["key"]
        yield serve, key
    finally:
        serve.stop()
        server.shutdown()


def _stream(front: tuple[Serve, str], max_tokens: int) -> list[Any]:
    """The events of one streamed completion (JSON, or "[DONE]"), read until the server closes."""
    return sse_events(front, "/v1/completions", {"model": "demo", "prompt": "hello", "max_tokens": max_tokens})


def sse_events(front: tuple[Serve, str], path: str, body: dict[str, Any]) -> list[Any]:
    """The events of `body` streamed (with usage) from `path`: JSON, or "[DONE]"."""
    serve, key = front
    events: list[Any] = []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", serve.base + path, json=body, timeout=30,
                      headers={"authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_a_bad_token_id_fails_its_stream_alone(front: tuple[Serve, str]) -> None:
    bad = _stream(front, BAD_ID)
    assert isinstance(bad[-1], dict) and bad[-1]["error"]["code"] == "generation_failed", bad[-3:]
    for _ in range(3):  # every later stream ends, with all of its events (none lags one behind)
        good = _stream(front, NORMAL)
        assert good[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in good[:-1] if isinstance(e, dict) and e["choices"]) == "a" * 7


def test_output_is_capped_at_max_tokens_and_billed_as_counted(front: tuple[Serve, str]) -> None:
    events = _stream(front, TOO_MANY)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == "b" * TOO_MANY
    usage = next(e["usage"] for e in events[:-1] if e.get("usage"))
    assert usage["completion_tokens"] == TOO_MANY
    serve, key = front
    whole = httpx.post(serve.base + "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": TOO_MANY},
                       headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == TOO_MANY, whole.text
    assert whole.json()["choices"][0]["finish_reason"] == "length"


def test_non_string_text_is_generation_failed(front: tuple[Serve, str]) -> None:
    serve, key = front
    whole = httpx.post(serve.base + "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": NOT_TEXT},
                       headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "generation_failed", whole.text
    events = _stream(front, NOT_TEXT)
    assert all(not isinstance(e, dict) or not e.get("choices") or isinstance(e["choices"][0].get("text"), str)
               for e in events)
    assert events[-1]["error"]["code"] == "generation_failed"


def test_an_endless_sse_line_is_refused(front: tuple[Serve, str]) -> None:
    serve, key = front
    whole = httpx.post(serve.base + "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": LONG_LINE},
                       headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "generation_failed", whole.text
    assert httpx.get(serve.base + "/health", timeout=10).status_code == 200


def _batch(front: tuple[Serve, str], max_tokens: int, lines: int) -> str:
    serve, key = front
    headers = {"authorization": f"Bearer {key}"}
    content = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "demo", "prompt": f"line {i}", "max_tokens": max_tokens}}) + "\n"
                      for i in range(lines)).encode()
    uploaded = httpx.post(serve.base + "/v1/files", headers=headers, files={"file": ("in.jsonl", content)},
                          data={"purpose": "batch"}, timeout=30)
    assert uploaded.status_code == 200, uploaded.text
    created = httpx.post(serve.base + "/v1/batches", headers=headers, timeout=30, json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def _wait_batch(front: tuple[Serve, str], batch_id: str, until: tuple[str, ...]) -> dict[str, Any]:
    serve, key = front
    for _ in range(1200):
        batch = httpx.get(f"{serve.base}/v1/batches/{batch_id}", headers={"authorization": f"Bearer {key}"},
                          timeout=30).json()
        if batch["status"] in until:
            return dict(batch)
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch['status']}")


def _error_lines(front: tuple[Serve, str], batch: dict[str, Any]) -> list[dict[str, Any]]:
    serve, key = front
    content = httpx.get(f"{serve.base}/v1/files/{batch['error_file_id']}/content",
                        headers={"authorization": f"Bearer {key}"}, timeout=30)
    return [json.loads(line) for line in content.text.splitlines()]


def test_batch_error_lines_keep_the_upstream_reason_in_the_log(front: tuple[Serve, str]) -> None:
    """Item 11: the upstream's name and error text stay out of batch lines, as out of answers."""
    batch = _wait_batch(front, _batch(front, FAILS, 2), ("completed", "failed"))
    lines = _error_lines(front, batch)
    assert len(lines) == 2 and all(line["error"]["code"] == "generation_failed" for line in lines)
    text = json.dumps(lines)
    assert "SECRET" not in text and "10.1.2.3" not in text and "fake" not in text, text


def test_lines_cancelled_mid_run_report_what_they_were_billed(front: tuple[Serve, str]) -> None:
    """Item 16: a line stopped by a cancel after it produced tokens carries its usage."""
    batch_id = _batch(front, SLOW, 4)
    serve, key = front
    _wait_batch(front, batch_id, ("in_progress",))
    time.sleep(2.0)  # the lines are running at the upstream (a token every 0.1 s, 6 s each)
    cancelled = httpx.post(f"{serve.base}/v1/batches/{batch_id}/cancel",
                           headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert cancelled.status_code == 200, cancelled.text
    batch = _wait_batch(front, batch_id, ("cancelled",))
    lines = _error_lines(front, batch)
    ran = [line for line in lines if line["error"]["code"] == "batch_cancelled" and "usage" in line]
    assert ran, lines
    for line in ran:
        usage = line["usage"]
        assert 0 < usage["completion_tokens"] < SLOW and usage["total_tokens"] == (
            usage["prompt_tokens"] + usage["completion_tokens"])
