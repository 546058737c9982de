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
            def do_POST(self) -> None:  # noqa: N802 - the http.server interface
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
