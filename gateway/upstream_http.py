"""The upstream link's HTTP/1.1 client for streamed completions: keep-alive connections, SSE by hand.

Why not httpx here: profiled under 50 closed-loop streams in front of a fake OpenAI server
(bench/profile_upstream_gateway.py), httpx, httpcore and anyio took 30 % of the gateway's busy
samples, most of it per SSE chunk (`aiter_lines` through three layers of stream wrappers) and per
request (httpcore looks at every pooled connection's socket attributes to find an idle one).
This client writes one prebuilt request head, reads the response on asyncio streams (chunked,
content-length or close-delimited) and yields each `data:` line's payload; the caller decodes it.
The link's health probes stay on httpx (one request a second).

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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_LINE = 1 << 20  # one SSE line or header block, at most (a chunk carries a few tokens)
MAX_ERROR_BODY = 64 * 1024  # of an error answer, kept for its message


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


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @property
    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class StreamedResponse:
    """One answer: its status, then its body as SSE payloads (`events`) or whole (`read`)."""

    def __init__(self, conn: _Conn, status: int, headers: dict[bytes, bytes]) -> None:
        self.status = status
        self._conn = conn
        self._reader = conn.reader
        self._chunked = headers.get(b"transfer-encoding", b"").endswith(b"chunked")
        length = headers.get(b"content-length")
        self._remaining: int | None = int(length) if length is not None and not self._chunked else None
        self.keep_alive = headers.get(b"connection") != b"close" and (self._chunked or self._remaining is not None)
        self.complete = False  # the whole body was read: the connection may serve the next request

    async def _pieces(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if self._chunked:
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                        pass
                    break
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif self._remaining is not None:
            while self._remaining > 0:
                data = await reader.read(min(self._remaining, 65536))
                if not data:
                    raise asyncio.IncompleteReadError(b"", self._remaining)
                self._remaining -= len(data)
                yield data
        else:
            while data := await reader.read(65536):
                yield data
        self.complete = True

    async def events(self) -> AsyncIterator[bytes]:
        """The payload of each `data:` line, as the server sent it (stripped)."""
        pending = b""
        async for piece in self._pieces():
            pending += piece
            if b"\n" not in piece:
                continue
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip()
        if pending.startswith(b"data:"):
            yield pending[5:].strip()

    async def drain(self, timeout_s: float) -> None:
        """Reads what is left of the body (after the last event), so the connection can be reused;
        a server that does not end it within `timeout_s` has it closed instead."""
        with contextlib.suppress(TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError):
            async with asyncio.timeout(timeout_s):
                async for _ in self._pieces():
                    pass

    async def read(self) -> bytes:
        body = b""
        async for piece in self._pieces():
            if len(body) < MAX_ERROR_BODY:
                body += piece
        return body[:MAX_ERROR_BODY]


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
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.origin.host, self.origin.port, ssl=self._ssl, limit=MAX_LINE,
                                        server_hostname=self.origin.host if self._ssl else None),
                self._connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise TransportError(f"connect failed ({type(exc).__name__})") from exc
        return _Conn(reader, writer)

    def _head(self, path: str, length: int, headers: dict[str, str]) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return (f"POST {self.origin.prefix}{path} HTTP/1.1\r\n".encode("latin-1") + self._fixed_head
                + f"content-length: {length}\r\n{extra}\r\n".encode("latin-1"))

    async def _send(self, conn: _Conn, request: bytes) -> StreamedResponse:
        conn.writer.write(request)
        await conn.writer.drain()
        head = await conn.reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].split(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ValueError("not an HTTP/1.x answer")
        headers: dict[bytes, bytes] = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        return StreamedResponse(conn, int(parts[1]), headers)

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
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
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
