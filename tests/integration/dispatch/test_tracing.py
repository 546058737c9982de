"""OpenTelemetry tracing end to end: `sluice serve` (a gateway process, a real worker process, the
session's Kafka broker) exports its spans over OTLP/HTTP to a receiver in this test, which decodes
them with the opentelemetry-proto package. One chat request sent with a W3C `traceparent` must
come back as one whole trace: the gateway's server span under the client's span, authenticate,
admission, the Kafka append, queue wait and dispatch under it, and the worker's queue, prefill and
decode spans, from the other process, under it too."""

from __future__ import annotations

import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.broker import free_port

from .test_serve import Serve, serve_environment, write_config
from .test_upstream import FRONT_TENANTS, FRONT_TOML, UPSTREAM_TOML, tenant_key

pytest.importorskip("opentelemetry.sdk")
trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GATEWAY_SPANS = {"POST /v1/chat/completions", "authenticate", "admission", "kafka.append", "queue.wait", "dispatch"}
WORKER_SPANS = {"worker.queue", "prefill", "decode"}


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it is sent, as a dict."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # the http.server interface names it
                body = self.rfile.read(int(self.headers["content-length"]))
                request = trace_service.ExportTraceServiceRequest.FromString(body)
                with lock:
                    for resource in request.resource_spans:
                        service = next(a.value.string_value for a in resource.resource.attributes
                                       if a.key == "service.name")
                        for scope in resource.scope_spans:
                            for span in scope.spans:
                                spans.append({"service": service, "name": span.name,
                                              "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                                              "parent": span.parent_span_id.hex(),
                                              "start": span.start_time_unix_nano, "end": span.end_time_unix_nano})
                answer = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def of_trace(self, trace_id: str) -> list[dict[str, Any]]:
        return [span for span in list(self.spans) if span["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_one_request_is_one_whole_trace_across_gateway_and_worker(tmp_path: Path, demo_model_dir: Path,
                                                                    bootstrap_servers: str) -> None:
    receiver = Receiver()
    env = serve_environment(tmp_path, write_config(tmp_path / "config", demo_model_dir), bootstrap_servers, "trace")
    env.update(SLUICE_TRACING_ENABLED="true", SLUICE_TRACING_OTLP_ENDPOINT=receiver.url)
    serve = Serve(tmp_path, env, free_port())
    try:
        serve.wait_ready()
        tenant = serve.admin("POST", "/admin/tenants", json={"name": "traced"}).json()
        key = serve.admin("POST", f"/admin/tenants/{tenant['id']}/keys", json={}).json()["key"]
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        answer = httpx.post(serve.base + "/v1/chat/completions", timeout=60,
                            headers={"authorization": f"Bearer {key}",
                                     "traceparent": f"00-{trace_id}-{client_span}-01"},
                            json={"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 5, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        for garbage in ("00-zz-yy-01", "x" * 5000, "00-" + "0" * 32 + "-" + "0" * 16 + "-01"):
            # A malformed or all-zero traceparent is ignored (a new trace starts), never an error.
            refused = httpx.post(serve.base + "/v1/chat/completions", timeout=60,
                                 headers={"authorization": f"Bearer {key}", "traceparent": garbage},
                                 json={"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2})
            assert refused.status_code == 200, refused.text
        spans: list[dict[str, Any]] = []
        for _ in range(300):  # the exporters send every 0.5 s
            spans = receiver.of_trace(trace_id)
            names = {(s["service"], s["name"]) for s in spans}
            if {("sluice-gateway", n) for n in GATEWAY_SPANS} | {("sluice-worker", n) for n in WORKER_SPANS} <= names:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"incomplete trace: {sorted({(s['service'], s['name']) for s in spans})}")
    finally:
        serve.stop()
        receiver.close()

    [server] = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    assert server["parent"] == client_span  # the client's traceparent was followed
    ids = {s["span_id"] for s in spans}
    for span in spans:
        if span is not server:
            assert span["parent"] in ids, f"{span['service']} {span['name']} hangs from a span not in the trace"
    by_name = {s["name"]: s for s in spans}
    for name in ("authenticate", "admission", "kafka.append", "queue.wait", "dispatch", *WORKER_SPANS):
        assert by_name[name]["parent"] == server["span_id"], name
    # The worker's spans come one after the other, within the request's span.
    assert by_name["prefill"]["start"] <= by_name["decode"]["start"] <= by_name["decode"]["end"]
    assert server["start"] <= by_name["queue.wait"]["start"] and by_name["decode"]["end"] <= server["end"]


def _wait_for(receiver: Receiver, trace_id: str, done: Any) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for _ in range(300):
        spans = receiver.of_trace(trace_id)
        if done(spans):
            return spans
        time.sleep(0.1)
    pytest.fail(f"incomplete trace: {sorted({(s['service'], s['name']) for s in spans})}")


def test_the_trace_goes_on_through_an_upstream(tmp_path: Path, demo_model_dir: Path, bootstrap_servers: str) -> None:
    """A front gateway forwards `traceparent` to its upstream (here another sluice, traced too): the
    upstream's server span hangs under the front's request span, its engine spans under its own."""
    receiver = Receiver()
    tracing_env = {"SLUICE_TRACING_ENABLED": "true", "SLUICE_TRACING_OTLP_ENDPOINT": receiver.url}
    up_port = free_port()
    up_env = serve_environment(tmp_path / "up", write_config(tmp_path / "up" / "config", demo_model_dir,
                                                             sluice_toml=UPSTREAM_TOML), bootstrap_servers, "tup")
    upstream = Serve(tmp_path / "up", {**up_env, **tracing_env}, up_port)
    front: Serve | None = None
    try:
        upstream.wait_ready()
        config = write_config(tmp_path / "front" / "config", demo_model_dir, sluice_toml=FRONT_TOML,
                              tenants_toml=FRONT_TENANTS)
        (config / "upstreams.toml").write_text(
            f'[[upstreams]]\nname = "second"\nbase_url = "http://127.0.0.1:{up_port}/v1"\n'
            'api_key_env = "UPSTREAM_KEY"\nmodels = ["demo"]\n')
        front_env = serve_environment(tmp_path / "front", config, bootstrap_servers, "tfront")
        front_env.update(tracing_env, UPSTREAM_KEY=tenant_key(upstream, "demo-chat"))
        front = Serve(tmp_path / "front", front_env, free_port(), "--workers", "0")
        front.wait_ready()
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        answer = httpx.post(front.base + "/v1/chat/completions", timeout=60,
                            headers={"authorization": f"Bearer {tenant_key(front, 'demo-chat')}",
                                     "traceparent": f"00-{trace_id}-{client_span}-01"},
                            json={"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 4, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        spans = _wait_for(receiver, trace_id, lambda found: {"POST /v1/chat/completions", "POST /v1/completions",
                                                             "dispatch", "prefill", "decode"}
                          <= {s["name"] for s in found})
    finally:
        if front is not None:
            front.stop()
        upstream.stop()
        receiver.close()
    [front_span] = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    [upstream_span] = [s for s in spans if s["name"] == "POST /v1/completions"]
    assert front_span["parent"] == client_span
    assert upstream_span["parent"] == front_span["span_id"]  # the forwarded traceparent
    assert {s["parent"] for s in spans if s["name"] in ("prefill", "decode")} == {upstream_span["span_id"]}
