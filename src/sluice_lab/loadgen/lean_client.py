"""A lean closed-loop streaming client for gateway-overhead runs (one keep-alive socket per stream).

`sluice_lab.loadgen.client` (httpx) costs a few hundred microseconds of CPU per SSE chunk; at the rates
a gateway comparison needs (hundreds of requests/s, 32 chunks each) on a 2-core machine the client
would become the bottleneck and its own queueing would be read as gateway overhead. This client
writes one prebuilt HTTP/1.1 request per stream and parses the chunked SSE response by hand on
asyncio streams, decoding each event with msgspec. The same client drives every target of a
comparison, so what differs between them is the server side only.

Timestamps are `time.perf_counter()` (one clock, this process). A chunk that carries text (chat
`delta.content` or completions `text`) is a token event; the first is the TTFT.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True, slots=True)
class Target:
    """Where to send and what: host/port/path plus the headers and the JSON body, sent as given."""

    host: str
    port: int
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    def request_bytes(self) -> bytes:
        head = [f"POST {self.path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                "Content-Type: application/json", "Accept: text/event-stream",
                f"Content-Length: {len(self.body)}"]
        head += [f"{name}: {value}" for name, value in self.headers]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + self.body


@dataclass(slots=True)
class StreamResult:
    sent: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    completion_tokens: int = 0
    error: str = ""  # "" = success; else http_NNN, stream, connect, closed
    error_detail: str = ""  # the start of an error body or event

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    def gaps(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


def _carries_text(event: Any) -> bool:
    choices = event.get("choices") if isinstance(event, dict) else None
    if not choices:
        return False
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content"))
    return bool(choice.get("text"))


class _Connection:
    def __init__(self, target: Target) -> None:
        self.target = target
        self.request = target.request_bytes()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.target.host, self.target.port,
                                                                 limit=1 << 20)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def stream(self) -> StreamResult:
        """One request on this connection (reopened when the server closed it)."""
        if self.writer is None or self.writer.is_closing():
            await self.open()
        reader, writer = self.reader, self.writer
        assert reader is not None and writer is not None  # set by open()
        result = StreamResult(sent=time.perf_counter())
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        keep_alive = headers.get(b"connection") != b"close"
        if headers.get(b"transfer-encoding") == b"chunked":
            await self._read_chunked(reader, result)
        else:
            body = await reader.readexactly(int(headers.get(b"content-length") or 0))
            if status != 200:
                result.error_detail = body[:200].decode("utf-8", "replace")
            elif body:
                event = _decode(body)
                result.completion_tokens = int((event.get("usage") or {}).get("completion_tokens") or 0)
                result.first_token = time.perf_counter()
        if status != 200:
            result.error = f"http_{status}"
        result.end = time.perf_counter()
        if not keep_alive:
            self.close()
        return result

    async def _read_chunked(self, reader: asyncio.StreamReader, result: StreamResult) -> None:
        buffer = b""
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # the empty trailer
                return
            data = await reader.readexactly(size + 2)
            now = time.perf_counter()
            buffer += data[:-2]
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                self._apply(event.strip(b"\r\n"), result, now)

    @staticmethod
    def _apply(event: bytes, result: StreamResult, now: float) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]" or not payload:
                continue
            chunk = _decode(payload)
            if isinstance(chunk, dict) and "error" in chunk:
                result.error = result.error or "stream"
                result.error_detail = result.error_detail or payload[:200].decode("utf-8", "replace")
            elif _carries_text(chunk):
                if result.first_token is None:
                    result.first_token = now
                result.token_times.append(now)
            usage = chunk.get("usage") if isinstance(chunk, dict) else None
            if usage:
                result.completion_tokens = int(usage.get("completion_tokens") or 0)


async def closed_loop(target: Target, concurrency: int, *, requests: int | None = None,
                      duration_s: float | None = None, ramp_s: float = 0.0,
                      on_start: Callable[[], Awaitable[None]] | None = None) -> tuple[list[StreamResult], float]:
    """`concurrency` streams, each sending its next request when the last one ends.

    `ramp_s` staggers the streams' first requests evenly over that many seconds (stream i starts
    at i * ramp_s / concurrency): with 0 they all start at the same instant, a burst, and with
    requests of equal length they stay in waves.

    Stops after `requests` in all, or (with `duration_s`) at the deadline, dropping what is in flight.
    Connections are opened before the clock starts, so connection set-up is not a request's TTFT.
    Returns the results and the wall time from the start to the last end.
    """
    if (requests is None) == (duration_s is None):
        raise ValueError("give exactly one of requests or duration_s")
    connections = [_Connection(target) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in connections))
    if on_start is not None:
        await on_start()
    results: list[StreamResult] = []
    remaining = [requests or 0]
    start = time.perf_counter()
    stop_at = start + duration_s if duration_s is not None else None

    async def one_stream(conn: _Connection, delay_s: float) -> None:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        while True:
            if stop_at is None:
                if remaining[0] <= 0:
                    return
                remaining[0] -= 1
            elif time.perf_counter() >= stop_at:
                return
            try:
                results.append(await conn.stream())
            except (ConnectionError, asyncio.IncompleteReadError, ValueError, OSError) as exc:
                failed = StreamResult(sent=time.perf_counter(), end=time.perf_counter(),
                                      error="closed" if isinstance(exc, asyncio.IncompleteReadError)
                                      else "connect")
                results.append(failed)
                conn.close()
                await asyncio.sleep(0.05)  # a refusing server is not hammered in a tight loop

    tasks = [asyncio.ensure_future(one_stream(c, i * ramp_s / concurrency)) for i, c in enumerate(connections)]
    try:
        # Timed runs end at the deadline: requests still in flight are dropped (their connections
        # closed), so a target that queues hundreds of requests does not stretch the run.
        timeout = None if stop_at is None else max(stop_at - time.perf_counter(), 0.0)
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for conn in connections:
            conn.close()
    return results, time.perf_counter() - start


def run_loop(coro: Awaitable[Any]) -> Any:
    """Run on uvloop when installed (the client's own cost is what this module keeps small)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]
