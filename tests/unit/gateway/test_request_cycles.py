"""A finished request leaves no reference cycle behind: reference counting frees it.

What a request leaves in a cycle only the collector frees, in a full collection that walks every
long-lived object with the GIL held. At 200 streams one took 12-60 ms every ~2 s and was most of
the gateway's TTFT p99 (docs/lab/gateway-overhead.md, "Eighth and ninth runs"). Each test runs one
request's objects through their real path with the collector off, drops the last outside
reference, and checks that a weak reference to them is dead at once.
"""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator

import pytest
from sluice_testing import state_of

from sluice.gateway.dispatch.dispatcher import Dispatcher
from sluice.gateway.dispatch.jobs import Job, ended_sink
from sluice.gateway.dispatch.links.upstream_http import UpstreamHTTP
from sluice.gateway.queueing.backend import QueuedSubmission
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta, SamplingParams
from sluice.settings import Settings

pytestmark = pytest.mark.unit


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _sse_server() -> tuple[asyncio.Server, int]:
    """A real HTTP/1.1 server on loopback: each POST gets three chunked SSE events and [DONE]."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for data in (b'{"n":1}', b'{"n":2}', b'{"n":3}', b"[DONE]"):
                    event = b"data: " + data + b"\n\n"
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError, StopIteration):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_streamed_answer_is_freed_by_reference_counting(no_collector: None) -> None:
    server, port = await _sse_server()
    client = UpstreamHTTP(f"http://127.0.0.1:{port}", {}, connect_timeout_s=5)
    try:
        events: list[bytes] = []

        def on_event(data: bytes) -> bool:
            events.append(data)
            return data == b"[DONE]"

        for _ in range(2):  # a fresh connection, then the pooled one
            events.clear()
            async with client.post("/v1/completions", b"{}", {}) as response:
                await response.each_event(on_event, drain_s=1)
                ref = weakref.ref(response)
            assert events == [b'{"n":1}', b'{"n":2}', b'{"n":3}', b"[DONE]"]
            del response
            for _ in range(3):  # the head's future is let go by the loop's wake-up handle
                await asyncio.sleep(0)
            assert ref() is None
    finally:
        await client.aclose()
        await asyncio.sleep(0.05)  # the server's handler reads the close
        server.close()
        await server.wait_closed()


class _Reader:
    """Like the HTTP handler's flight: it holds its submission, whose listener is its own method."""

    def __init__(self, submission: QueuedSubmission) -> None:
        self.submission = submission
        self.deltas: list[RequestDelta] = []
        submission.listen(self.on_delta)

    def on_delta(self, delta: RequestDelta) -> None:
        self.deltas.append(delta)


def test_a_submission_lets_go_of_its_listener_at_the_final_delta(no_collector: None) -> None:
    submission = QueuedSubmission("r1", on_abort=lambda request_id: None)
    submission.deliver(RequestDelta(request_id="r1", token_ids=(5,), num_output_tokens=1))
    reader = _Reader(submission)  # the queued delta first, then each as it is delivered
    submission.deliver(RequestDelta(request_id="r1", finish_reason=FinishReason.LENGTH, num_output_tokens=1))
    assert [d.finish_reason for d in reader.deltas] == [None, FinishReason.LENGTH]
    ref = weakref.ref(reader)
    del reader, submission
    assert ref() is None

    # A submission whose final delta was queued before anyone listened keeps no listener either.
    early = QueuedSubmission("r2", on_abort=lambda request_id: None)
    early.deliver(RequestDelta(request_id="r2", finish_reason=FinishReason.STOP))
    late = _Reader(early)
    ref = weakref.ref(late)
    del late, early
    assert ref() is None


class _Client:
    """A client's stream as the Kafka backend makes it: it holds its job, whose sink is its method."""

    def __init__(self) -> None:
        self.job: Job | None = None
        self.final: RequestDelta | None = None

    def deliver(self, delta: RequestDelta) -> None:
        self.final = delta


def test_a_finished_job_drops_its_sink(no_collector: None) -> None:
    dispatcher = Dispatcher(Settings(), lambda job, final: None)
    client = _Client()
    request = GenerateRequest(request_id="j1", tenant_id="t", model="m", priority=Priority.STANDARD,
                              prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=4),
                              cache_salt="t", arrival_time=time.time())
    client.job = Job(state=state_of(request), sink=client.deliver)
    dispatcher.enqueue(client.job)
    dispatcher.cancel("j1")  # queued, so it finishes at once (an abort)
    assert client.final is not None and client.final.finish_reason is FinishReason.ABORT
    assert client.job.sink is ended_sink
    ref = weakref.ref(client)
    del client
    assert ref() is None
