"""The worker port: worker processes connect here over TCP and become `WorkerConn` links.

Registration: the gateway opens every connection with a `WorkerChallenge` (a random nonce) and
sends nothing else until the peer answers with a `WorkerRegister` whose proof is the HMAC of that
nonce under the shared worker secret (compared in constant time). A peer that fails, stalls or
sends anything else is logged (never the secret) and disconnected with a `WorkerRejected`; it
never sees a request or a tenant id. A worker id that is already connected is refused: a live
worker is never evicted by a newcomer (a restarted worker's old connection ends at its EOF, or at
the heartbeat timeout, and its retry then succeeds). The port speaks TLS when a certificate is
configured.

Once registered, the connection's frames go to the dispatcher: `RequestDelta`s to `deliver`,
`WorkerCapacity` reports to `report`, `KvEvents` (its challenge asks for them) to `kv_events`; a
frame of an unknown kind or a malformed one is logged and skipped; the connection's end (EOF, an
error) loses the worker (`lose`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import ssl
import time
from typing import TYPE_CHECKING

import msgspec

from sluice import telemetry
from sluice.gateway.dispatch.links.base import EngineLink
from sluice.protocol import (
    MAX_FRAME_BYTES,
    READ_CHUNK_BYTES,
    AbortRequest,
    FrameDecoder,
    GenerateRequest,
    KvEvents,
    Message,
    RequestDelta,
    WorkerCapacity,
    WorkerChallenge,
    WorkerRegister,
    WorkerRejected,
    encode_frame,
    proof_matches,
    read_opening,
)
from sluice.settings import Settings

if TYPE_CHECKING:
    from sluice.gateway.dispatch.dispatcher import Dispatcher

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0  # a peer must register this soon after connecting
REGISTER_MAX_FRAME_BYTES = 64 * 1024  # an unauthenticated peer's frames are small or refused


class WorkerConn(EngineLink):
    """A worker process connected to the worker port: requests and aborts go out as frames."""

    def __init__(self, register: WorkerRegister, writer: asyncio.StreamWriter, max_index_blocks: int) -> None:
        super().__init__(register.worker_id, frozenset(m.name for m in register.models), register.capacity,
                         register.device, register.pid, max_index_blocks=max_index_blocks)
        self.writer = writer

    def _send(self, request: GenerateRequest) -> None:
        self.writer.write(encode_frame(request))

    def _abort(self, request_id: str) -> None:
        self.writer.write(encode_frame(AbortRequest(request_id)))

    def close(self) -> None:
        self.writer.close()


class WorkerRefused(Exception):
    """A connection that is not accepted as a worker; the message is safe to log and to send."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def worker_secret_for(settings: Settings) -> str:
    """The configured worker secret, or a fresh random one when the worker port is loopback-only."""
    gw = settings.gateway
    if gw.worker_secret:
        return gw.worker_secret
    if not _is_loopback(gw.worker_host):
        raise ValueError(
            f"gateway.worker_secret (SLUICE_GATEWAY_WORKER_SECRET) must be set when workers may connect "
            f"from other hosts (worker_host {gw.worker_host!r}); give the same value to every worker")
    return secrets.token_urlsafe(32)


def server_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    gw = settings.gateway
    if not gw.worker_tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(gw.worker_tls_cert, gw.worker_tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"gateway.worker_tls_cert/worker_tls_key cannot be loaded: {exc}") from None
    return context


class WorkerPort:
    """The TCP server worker processes connect to; each registered connection is a `WorkerConn`."""

    def __init__(self, host: Dispatcher, settings: Settings) -> None:
        self._host = host
        self._settings = settings
        self._server: asyncio.Server | None = None
        self._conn_tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.worker_secret = ""  # set by start(): configured, or generated for local workers
        self.rejected_connections = 0

    async def start(self, host: str, port: int) -> None:
        self.worker_secret = worker_secret_for(self._settings)
        context = server_ssl_context(self._settings)
        try:
            self._server = await asyncio.start_server(self._serve_worker, host, port, ssl=context)
        except OSError as exc:
            raise ValueError(f"cannot listen for workers on {host}:{port}: {exc.strerror}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("worker port listening on %s:%d (%s)", host, self.port, "TLS" if context else "plain TCP")

    def close(self) -> None:
        """Stops accepting connections (the dispatcher then loses every worker, closing theirs)."""
        if self._server is not None:
            self._server.close()

    async def wait_closed(self) -> None:
        # Closing a worker's socket ends its connection task (EOF) without cancelling it: asyncio
        # logs cancelled connection callbacks as errors.
        if self._conn_tasks:
            _, pending = await asyncio.wait(list(self._conn_tasks), timeout=2.0)
            for task in pending:
                task.cancel()

    async def _serve_worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conn_tasks.add(task)
        decoder = FrameDecoder(max_frame_bytes=REGISTER_MAX_FRAME_BYTES)
        worker: WorkerConn | None = None
        reason = "closed the connection"
        try:
            nonce = secrets.token_bytes(32)
            writer.write(encode_frame(WorkerChallenge(nonce, kv_events=True)))
            try:
                register, rest = await asyncio.wait_for(self._read_register(reader, decoder), REGISTER_TIMEOUT_S)
                self._check_register(register, nonce)
            except (WorkerRefused, TimeoutError, ValueError, msgspec.DecodeError) as exc:
                self._refuse(writer, exc)
                return
            worker = self._register(register, writer)
            decoder.max_frame_bytes = MAX_FRAME_BYTES
            decoder.skip_undecodable = True  # an unknown kind from a newer worker is logged, skipped
            for message in rest:
                self._on_message(worker, message)
            while True:
                data = await reader.read(READ_CHUNK_BYTES)
                if not data:
                    break
                if self._host.workers.get(worker.worker_id) is not worker:
                    return  # dropped by the monitor meanwhile
                for message in decoder.feed(data):
                    self._on_message(worker, message)
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            reason = f"connection error ({exc!r})"
        except asyncio.CancelledError:
            reason = "gateway stopping"
            raise
        finally:
            if task is not None:
                self._conn_tasks.discard(task)
            if worker is not None:
                self._host.lose(worker, reason)  # a no-op when the monitor dropped it
            writer.close()

    @staticmethod
    async def _read_register(reader: asyncio.StreamReader,
                             decoder: FrameDecoder) -> tuple[WorkerRegister, list[Message]]:
        """The peer's first message, which must be a WorkerRegister, and whatever came with it."""
        messages = await read_opening(reader, decoder)
        if not messages:
            raise WorkerRefused("closed the connection before registering")
        first = messages[0]
        if not isinstance(first, WorkerRegister):
            raise WorkerRefused(f"sent {type(first).__name__} instead of registering")
        return first, messages[1:]

    def _check_register(self, message: WorkerRegister, nonce: bytes) -> None:
        if not message.proof or not proof_matches(self.worker_secret, nonce, message.worker_id, message.proof):
            raise WorkerRefused(f"worker {message.worker_id!r} did not prove the worker secret "
                                "(missing or wrong SLUICE_GATEWAY_WORKER_SECRET)")
        if message.worker_id in self._host.workers:
            raise WorkerRefused(f"worker id {message.worker_id!r} is already connected; "
                                "a live worker is never replaced (give each worker its own id)")
        if not message.models:
            raise WorkerRefused(f"worker {message.worker_id!r} announced no model")
        for model in message.models:
            expected = self._host.expected_models.get(model.name)
            if expected is None:
                if self._host.expected_models:
                    known = ", ".join(sorted(self._host.expected_models))
                    raise WorkerRefused(f"worker {message.worker_id!r} serves {model.name!r}, which this "
                                        f"gateway does not list (models.toml has {known})")
                continue
            if expected.tokenizer and model.tokenizer and expected.tokenizer != model.tokenizer:
                raise WorkerRefused(f"worker {message.worker_id!r} serves {model.name!r} with a different "
                                    "tokenizer than the gateway's copy of that model")
            if model.max_model_len < expected.max_model_len:
                raise WorkerRefused(
                    f"worker {message.worker_id!r} serves {model.name!r} with max_model_len "
                    f"{model.max_model_len}, shorter than the gateway's {expected.max_model_len}")

    def _refuse(self, writer: asyncio.StreamWriter, exc: BaseException) -> None:
        peer = writer.get_extra_info("peername")
        if isinstance(exc, TimeoutError):
            reason = f"did not register within {REGISTER_TIMEOUT_S:.0f}s"
        elif isinstance(exc, WorkerRefused):
            reason = str(exc)
        else:
            reason = f"sent an unreadable registration ({type(exc).__name__})"
        self.rejected_connections += 1
        log.warning("worker connection from %s refused: %s", peer, reason)
        with contextlib.suppress(Exception):
            writer.write(encode_frame(WorkerRejected(reason)))

    def _register(self, message: WorkerRegister, writer: asyncio.StreamWriter) -> WorkerConn:
        worker = WorkerConn(message, writer, self._settings.routing.max_index_blocks)
        self._host.attach(worker)
        telemetry.observe_worker(message.capacity)
        log.info("worker %s registered (models %s, device %s, pid %d)",
                 worker.worker_id, ", ".join(sorted(worker.models)), worker.device, worker.pid)
        return worker

    def _on_message(self, worker: WorkerConn, message: object) -> None:
        worker.last_seen = time.monotonic()
        if isinstance(message, RequestDelta):
            self._host.deliver(worker, message)
        elif isinstance(message, WorkerCapacity):
            self._host.report(worker, message)
        elif isinstance(message, KvEvents):
            self._host.kv_events(worker, message)
