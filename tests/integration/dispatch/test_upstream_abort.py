"""An upstream job aborted at any point after it was sent ends with one final ABORT delta, also
when the abort comes before the link's task took its first step (a batch cancelled right after
the dispatch round that sent its line: the line was left without a result and the batch stuck
in `cancelling`).

The upstream is a real HTTP server (a thread of the test) streaming a token every 50 ms; the link
is a real `UpstreamLink`. Its host is a recorder in place of the dispatcher: the timing (an abort
in the very loop tick of the send) cannot be provoked through the whole gateway on demand.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sluice.gateway.dispatch.links.upstream import UpstreamLink
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams
from sluice.settings import Settings, UpstreamSpec

pytestmark = pytest.mark.integration


class _Slow(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        try:
            for _ in range(100):
                chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [5], "finish_reason": None}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:  # the link closed the stream: the abort reached the server
            return


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _Recorder:
    """The dispatcher's side of the link (`LinkHost`): what it delivers, per request."""

    def __init__(self) -> None:
        self.deltas: dict[str, list[RequestDelta]] = {}

    def deliver(self, worker: Any, delta: RequestDelta) -> None:
        self.deltas.setdefault(delta.request_id, []).append(delta)

    def wake(self) -> None:
        return None

    def lose_job(self, worker: Any, request_id: str, reason: str) -> None:
        raise AssertionError(f"{request_id} lost: {reason}")


def _request(i: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"batch_x-{i}", tenant_id="t", model="demo", priority=Priority.BATCH,
                           prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=100),
                           cache_salt="s", arrival_time=time.time())


@pytest.mark.parametrize("ticks", [0, 1, 2, 5, 20])
async def test_an_abort_at_any_point_after_the_send_ends_the_job_once(upstream: str, ticks: int) -> None:
    host = _Recorder()
    link = UpstreamLink(UpstreamSpec(name="slow", base_url=upstream, models=("demo",)), host,  # type: ignore[arg-type]
                        Settings())
    try:
        for i in range(5):  # a few times: with ticks > 0 the point the task reached varies
            request = _request(i)
            link.send(request)
            for _ in range(ticks):
                await asyncio.sleep(0)
            link.abort(request.request_id)
            # Until its final delta (the bound only turns a hang into a failure).
            for _ in range(400):
                finals = [d for d in host.deltas.get(request.request_id, []) if d.finish_reason is not None]
                if finals:
                    break
                await asyncio.sleep(0.01)
            assert [d.finish_reason for d in finals] == [FinishReason.ABORT], (ticks, i)
        await asyncio.sleep(0.05)  # a late second final delta would show here
        for rid, deltas in host.deltas.items():
            assert sum(d.finish_reason is not None for d in deltas) == 1, rid
    finally:
        await link.shutdown()
