"""The upstream link's HTTP/1.1 client for streamed completions: keep-alive connections, SSE parsed as it arrives.

Why not httpx here: profiled under 50 closed-loop streams in front of a fake OpenAI server
(bench/profile_upstream_gateway.py), httpx, httpcore and anyio took 30 % of the gateway's busy
samples, most of it per SSE chunk (`aiter_lines` through three layers of stream wrappers) and per
request (httpcore looks at every pooled connection's socket attributes to find an idle one).
This client writes one prebuilt request head and reads the answer (chunked, content-length or
close-delimited). The link's health probes stay on httpx (one request a second).

Why not asyncio streams either: with a `StreamReader` every SSE chunk cost a step of the reading
task (woken by `feed_data`), a `readuntil` for the chunk size, a `readexactly` and two async
generators (chunks -> lines -> payloads); at 200 streams of 32 tokens that is ~7,000 chunks a
second on one core. Here each connection is an `asyncio.Protocol`: the answer's framing and its
SSE lines are parsed within `data_received`, and each `data:` payload goes to the caller's
callback there (`StreamedResponse.each_event`). The request's task wakes only for the head and for
the end of the body.

Connections: idle ones are kept for reuse. One that fails before any byte of its answer arrived
(the server closed it while idle) is replaced once by a fresh one; a fresh one that fails is a
`TransportError`, as is a connection cut mid-answer. Leaving `post` early (the job aborted, its
task cancelled) closes the connection: the server sees the close, and vLLM or sluice abort the
request on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

MAX_LINE = 1 << 20  # one chunk-size line or header block, at most (a chunk carries a few tokens)
MAX_ERROR_BODY = 64 * 1024  # of an error answer, kept for its message

_SIZE, _DATA, _CRLF, _TRAILER = range(4)  # where a chunked body's parser is


class TransportError(Exception):
    """The upstream could not be reached, or the connection broke mid-answer."""


@dataclass(frozen=True, slots=True)
class Origin:
    host: str
    port: int
    prefix: str  # path prefix before /v1/... ("" for the server's root)
    tls: bool

    @classmethod
    def parse(cls, root: str) -> Origin:
        parts = urlsplit(root)
        tls = parts.scheme == "https"
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {parts.scheme}://...")
        return cls(parts.hostname, parts.port or (443 if tls else 80), parts.path.rstrip("/"), tls)


class BodyFraming:
    """A body's framing undone as its bytes arrive: `feed` returns the body's pieces in them;
    `done` once the body ended (a close-delimited one ends at `eof`). ValueError on a malformed
    chunked body."""

    def __init__(self, *, chunked: bool, length: int | None) -> None:
        self._chunked = chunked
        self._remaining = length  # content-length: bytes still to come; None: chunked or until close
        self._state = _SIZE
        self._left = 0  # bytes of the current chunk's data still to come
        self._kept = b""  # the start of a line (chunk size, trailer) not ended yet
        self.done = not chunked and length == 0

    def feed(self, data: bytes) -> list[bytes]:
        if self.done or not data:
            return []
        if self._chunked:
            return self._feed_chunked(data)
        if self._remaining is None:
            return [data]
        piece = data[: self._remaining]
        self._remaining -= len(piece)
        self.done = self._remaining == 0
        return [piece]

    def eof(self) -> None:
        """The connection ended: a close-delimited body is complete, any other one was cut."""
        if self.done:
            return
        if self._chunked or self._remaining is not None:
            raise asyncio.IncompleteReadError(b"", self._remaining)
        self.done = True

    def _feed_chunked(self, data: bytes) -> list[bytes]:
        buf = self._kept + data if self._kept else data
        self._kept = b""
        pieces: list[bytes] = []
        pos, end = 0, len(buf)
        while pos < end and not self.done:
            state = self._state
            if state == _DATA:
                take = min(self._left, end - pos)
                pieces.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = _CRLF
            elif state == _CRLF:  # the two bytes after a chunk's data
                if end - pos < 2:
                    break
                pos += 2
                self._state = _SIZE
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                line = buf[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    self.done = line == b""  # trailers end at a blank line
                    continue
                size = int(line.split(b";", 1)[0], 16)  # ValueError on garbage
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._state, self._left = _DATA, size
        if not self.done and pos < end:
            self._kept = buf[pos:]
            if len(self._kept) > MAX_LINE:
                raise ValueError("a chunk-size or trailer line is too long")
        return pieces


class StreamedResponse:
    """One answer: its status, then its body as SSE payloads (`each_event`) or whole (`read`)."""

    def __init__(self, conn: _Conn, status: int, headers: dict[bytes, bytes]) -> None:
        self.status = status
        self._conn = conn
        chunked = headers.get(b"transfer-encoding", b"").endswith(b"chunked")
        length = headers.get(b"content-length")
        remaining = int(length) if length is not None and not chunked else None
        self._framing = BodyFraming(chunked=chunked, length=remaining)
        self.keep_alive = headers.get(b"connection") != b"close" and (chunked or remaining is not None)
        self.complete = False  # the whole body was read: the connection may serve the next request
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held: list[bytes] = []  # pieces that arrived before the caller asked for them
        self._take: Callable[[bytes], None] | None = None  # where pieces go once asked for
        # After the last event the caller wants: the rest of the body is only awaited (for the
        # connection's reuse), within a bound; a failure then ends nothing but the connection.
        self._draining = False
        self._drain_timer: asyncio.TimerHandle | None = None

    # ---- fed by the connection (within its read callbacks) ----------------------------------

    def _feed(self, data: bytes) -> None:
        if self._ended.done():
            return
        try:
            for piece in self._framing.feed(data):
                if self._take is None:
                    self._held.append(piece)
                else:
                    self._take(piece)
            if self._framing.done:
                self._end()
        except Exception as exc:  # a malformed body, or the caller's callback raised: to the caller
            self._fail(exc)

    def _eof(self) -> None:
        if self._ended.done():
            return
        try:
            self._framing.eof()
        except asyncio.IncompleteReadError as exc:
            self._fail(exc)
            return
        self._end()

    def _end(self) -> None:
        self.complete = True
        self._conn.release(self)
        self._settle()

    def _fail(self, exc: BaseException) -> None:
        self._conn.close()
        if self._draining:
            self._settle()  # the answer had all the caller wanted: not complete, so not reused
        elif not self._ended.done():
            self._ended.set_exception(exc)

    def _settle(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        if not self._ended.done():
            self._ended.set_result(None)

    def _drain_within(self, drain_s: float) -> None:
        self._draining = True
        if not self._ended.done():
            self._drain_timer = asyncio.get_running_loop().call_later(
                drain_s, self._fail, TimeoutError("the body did not end"))

    async def _relay(self, take: Callable[[bytes], None]) -> None:
        """Hands `take` the pieces that arrived before this call, then each one as it arrives
        (within the connection's read callbacks), until the body ends; raises what `take` raised,
        or why the connection failed. `take` is dropped at the end: it holds this answer, and no
        cycle is left for the collector."""
        try:
            held, self._held = self._held, []
            self._take = take
            for piece in held:
                take(piece)
        except Exception as exc:
            self._conn.close()
            if self._ended.done():  # the body had ended already: this is the answer's failure
                if not self._ended.cancelled():
                    self._ended.exception()  # (marked as retrieved: `exc` is raised instead)
                raise
            self._ended.set_exception(exc)
        try:
            await self._ended
        finally:
            self._take = None

    # ---- read by the caller -----------------------------------------------------------------

    async def each_event(self, on_event: Callable[[bytes], bool], *, drain_s: float) -> None:
        """Hands the payload of each `data:` line (stripped) to `on_event` as it arrives, within
        the connection's read callback. `on_event` returns True for the last one it wants
        ([DONE]); the rest of the body is then read for up to `drain_s` (so the connection can be
        reused; a server that does not end it by then has it closed). Returns when the body
        ended; raises what `on_event` raised, or why the connection failed."""
        pending = bytearray()  # the line not ended yet: appended in place (bytes += was quadratic)
        stopped = False

        def take(piece: bytes) -> None:
            nonlocal pending, stopped
            if stopped:
                return
            if b"\n" not in piece:
                pending += piece
                if len(pending) > MAX_LINE:  # a chunk is a few tokens: this is no SSE stream
                    raise ValueError(f"an SSE line longer than {MAX_LINE} bytes")
                return
            *lines, rest = (bytes(pending) + piece).split(b"\n")
            pending = bytearray(rest)
            if len(pending) > MAX_LINE:
                raise ValueError(f"an SSE line longer than {MAX_LINE} bytes")
            for line in lines:
                if line.startswith(b"data:") and on_event(line[5:].strip()):
                    stopped = True
                    self._drain_within(drain_s)
                    return

        await self._relay(take)
        if not stopped and pending.startswith(b"data:"):
            on_event(bytes(pending[5:]).strip())

    async def read(self) -> bytes:
        body = bytearray()

        def take(piece: bytes) -> None:
            if len(body) < MAX_ERROR_BODY:
                body.extend(piece)

        await self._relay(take)
        return bytes(body[:MAX_ERROR_BODY])


def _parse_head(conn: _Conn, head: bytes) -> StreamedResponse:
    status_line, *lines = head.split(b"\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError("not an HTTP/1.x answer")
    headers: dict[bytes, bytes] = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    return StreamedResponse(conn, int(parts[1]), headers)


class _Conn(asyncio.Protocol):
    """One keep-alive connection: what arrives goes to the answer being read (none while idle)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._closed = False
        self._head = b""  # the answer's head so far
        self._head_waiter: asyncio.Future[StreamedResponse] | None = None
        self._response: StreamedResponse | None = None

    @property
    def usable(self) -> bool:
        return not self._closed and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        self._closed = True
        if self.transport is not None:
            self.transport.close()

    def release(self, response: StreamedResponse) -> None:
        """`response`'s body ended: the connection is idle."""
        if self._response is response:
            self._response = None

    async def exchange(self, request: bytes) -> StreamedResponse:
        """Writes a request; the answer once its head arrived (its body follows as it arrives)."""
        if not self.usable or self.transport is None:
            raise ConnectionResetError("the connection is closed")
        self._response, self._head = None, b""
        self._head_waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        try:
            return await self._head_waiter
        finally:
            self._head_waiter = None

    # ---- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP (or TLS) connection's

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is not None:
            response._feed(data)
            return
        waiter = self._head_waiter
        if waiter is None or waiter.done():
            self.close()  # bytes no request asked for: this connection cannot be trusted any more
            return
        head = self._head + data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            if len(head) > MAX_LINE:
                waiter.set_exception(ValueError("the answer's head is too long"))
                self.close()
            self._head = head
            return
        self._head = b""
        try:
            response = _parse_head(self, head[:end])
        except ValueError as exc:
            waiter.set_exception(exc)
            self.close()
            return
        self._response = response
        waiter.set_result(response)
        response._feed(head[end + 4 :])

    def eof_received(self) -> bool | None:
        self._lost(None)
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._lost(exc)

    def _lost(self, exc: Exception | None) -> None:
        response, self._response = self._response, None
        if response is not None:
            response._eof()
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_exception(asyncio.IncompleteReadError(self._head, None))
            else:
                waiter.set_exception(ConnectionResetError(f"the connection was lost ({type(exc).__name__})"))


class UpstreamHTTP:
    """POSTs JSON to one origin and streams the answers, over a pool of keep-alive connections."""

    def __init__(self, root: str, headers: dict[str, str], *, connect_timeout_s: float) -> None:
        self.origin = Origin.parse(root)
        self._connect_timeout_s = connect_timeout_s
        self._ssl = ssl.create_default_context() if self.origin.tls else None
        host = self.origin.host if ":" not in self.origin.host else f"[{self.origin.host}]"
        fixed = {"host": f"{host}:{self.origin.port}", "content-type": "application/json",
                 "accept": "text/event-stream", **{k.lower(): v for k, v in headers.items()}}
        self._fixed_head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self._idle: list[_Conn] = []
        self._closed = False

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Conn, self.origin.host, self.origin.port, ssl=self._ssl,
                                       server_hostname=self.origin.host if self._ssl else None),
                self._connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise TransportError(f"connect failed ({type(exc).__name__})") from exc
        return conn

    def _head(self, path: str, length: int, headers: dict[str, str]) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return (f"POST {self.origin.prefix}{path} HTTP/1.1\r\n".encode("latin-1") + self._fixed_head
                + f"content-length: {length}\r\n{extra}\r\n".encode("latin-1"))

    async def _send(self, conn: _Conn, request: bytes) -> StreamedResponse:
        return await conn.exchange(request)

    @contextlib.asynccontextmanager
    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[StreamedResponse]:
        """The answer to one POST; its connection goes back to the pool only when read to its end."""
        if self._closed:
            raise TransportError("the client is closed")
        request = self._head(path, len(body), headers) + body
        conn: _Conn | None = None
        while self._idle and conn is None:
            candidate = self._idle.pop()
            if candidate.usable:
                conn = candidate
            else:
                candidate.close()
        reused = conn is not None
        response: StreamedResponse | None = None
        try:
            try:
                if conn is None:
                    conn = await self._connect()
                response = await self._send(conn, request)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                if conn is not None:
                    conn.close()
                if not reused:
                    raise TransportError(f"the connection broke ({type(exc).__name__})") from exc
                conn = await self._connect()  # the server had closed the idle one: once more, afresh
                try:
                    response = await self._send(conn, request)
                except (ConnectionError, asyncio.IncompleteReadError) as again:
                    raise TransportError(f"the connection broke ({type(again).__name__})") from again
            try:
                yield response
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                raise TransportError(f"the connection broke mid-answer ({type(exc).__name__})") from exc
        finally:
            if conn is not None:
                if response is not None and response.complete and response.keep_alive and not self._closed:
                    self._idle.append(conn)
                else:
                    conn.close()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
