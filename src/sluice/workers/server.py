"""The worker process: one engine host connected to one or more gateways over TCP.

Two threads. The main thread runs the engine host (workers/engine_host.py: the one loop that
steps the engine, the same as the gateway's in-process kind runs); an IO thread runs an asyncio
loop with one link per gateway replica (`--gateway a:p,b:p,...`). Each link connects to its
gateway's worker port (TLS when a CA file is configured), answers the gateway's challenge with a
WorkerRegister carrying the HMAC proof of the shared worker secret (the secret itself never
crosses the wire) and what it serves (name, max length, tokenizer identity), then forwards frames:
GenerateRequest / AbortRequest in (to the host, from this connection), RequestDelta /
WorkerCapacity out, and KvEvents (each step's prefix-cache changes) to a gateway whose challenge
asked for them. Socket IO never blocks a step.

Many gateways, one engine: each connection is a client of the host (`_Connection`), so a
request's deltas go back only on the connection it came on (a stream never crosses replicas),
capacity goes to every connection with its own `num_received` (which its gateway uses to know how
many it sent are not yet in the engine), and a request id already in the engine that arrives on
another connection is answered there with an error final delta.

If a link's connection drops, only the requests of that connection are aborted in the engine (its
gateway has already failed or re-queued them); the other links' requests run on. Each link
reconnects with backoff by itself, and a gateway that refused this worker is asked again after
`rejected_retry_s`, so workers outlive any gateway's restart. An engine that fails ends every
request with an error and the process exits (`sluice serve` restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from sluice import tracing
from sluice.protocol import (
    READ_CHUNK_BYTES,
    AbortRequest,
    FrameDecoder,
    GenerateRequest,
    KvEvents,
    RequestDelta,
    ServedModelInfo,
    WorkerCapacity,
    WorkerChallenge,
    WorkerRegister,
    WorkerRejected,
    encode_frame,
    read_opening,
    tokenizer_identity,
    worker_proof,
)
from sluice.settings import TracingSettings
from sluice.workers.engine_host import EngineHost

if TYPE_CHECKING:
    from sluice.workers.config import EngineConfig
    from sluice.workers.engine import LLMEngine

log = logging.getLogger(__name__)

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    gateways: tuple[Address, ...]  # every gateway replica's worker address; one link each
    worker_id: str
    model_name: str
    heartbeat_interval_s: float = 1.0
    reconnect_max_s: float = 2.0
    parent_pid: int | None = None  # exit once this process is gone (workers spawned by `sluice serve`)
    secret: str = ""  # the shared worker secret (from settings / SLUICE_GATEWAY_WORKER_SECRET)
    tls_ca: str = ""  # verify the gateways' certificates against this CA file; "" = plain TCP
    rejected_retry_s: float = 5.0  # a gateway that refused this worker is asked again this much later
    tracing: TracingSettings = field(default_factory=TracingSettings)  # [tracing]: spans of its requests

    def __post_init__(self) -> None:
        if not self.gateways:
            raise ValueError("a worker needs at least one gateway address")
        if len(set(self.gateways)) != len(self.gateways):
            raise ValueError("the same gateway address is listed twice")


class _Refused(Exception):
    """The gateway did not accept this worker (its reason: wrong secret, duplicate id, ...)."""


def client_ssl_context(ca_file: str) -> ssl.SSLContext | None:
    if not ca_file:
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"gateway.worker_tls_ca {ca_file!r} cannot be loaded: {exc}") from None


def parse_address(value: str) -> Address:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT for the gateway's worker address, got {value!r}")
    if host.startswith("[") and host.endswith("]"):  # [::1]:8100, an IPv6 address
        host = host[1:-1]
    return host, int(port)


def parse_gateways(value: str) -> tuple[Address, ...]:
    """`HOST:PORT[,HOST:PORT...]`: every gateway replica a worker serves. Raises ValueError on an
    empty item, a malformed address or one listed twice."""
    addresses: list[Address] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"expected HOST:PORT[,HOST:PORT...] for --gateway, got an empty item in {value!r}")
        address = parse_address(item)
        if (address[0].lower(), address[1]) in {(h.lower(), p) for h, p in addresses}:
            raise ValueError(f"--gateway lists {item} twice")
        addresses.append(address)
    return tuple(addresses)


class _GatewayLink:
    """One gateway: keeps a connection to it up (a task on the IO loop) and moves frames both ways."""

    def __init__(self, address: Address, options: WorkerOptions, host: EngineHost,
                 context: ssl.SSLContext | None) -> None:
        self.host, self.port = address
        self._options = options
        self._engine_host = host
        self._ssl = context
        self._outbox: asyncio.Queue[bytes] | None = None
        self._generation = 0

    def enqueue(self, generation: int, frames: list[bytes]) -> None:
        """On the IO loop: frames for a connection that is gone are dropped."""
        if self._outbox is not None and generation == self._generation:
            for frame in frames:
                self._outbox.put_nowait(frame)

    async def connect_forever(self, register: WorkerRegister) -> None:
        opts = self._options
        backoff = 0.05
        while True:
            try:
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None)
            except OSError as exc:
                if isinstance(exc, ssl.SSLError):
                    log.warning("TLS handshake with the gateway at %s:%d failed (%s); retrying",
                                self.host, self.port, exc.reason)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, opts.reconnect_max_s)
                continue
            backoff = 0.05
            self._generation += 1
            generation = self._generation
            self._outbox = asyncio.Queue()
            connection = _Connection(self, generation, asyncio.get_running_loop())
            self._engine_host.connect(connection)
            log.info("connected to the gateway at %s:%d", self.host, self.port)
            try:
                decoder = FrameDecoder()
                challenge = await asyncio.wait_for(self._challenge(reader, decoder), 30.0)
                connection.kv_events = challenge.kv_events  # an older gateway does not read them
                proof = worker_proof(opts.secret, challenge.nonce, register.worker_id)
                writer.write(encode_frame(msgspec.structs.replace(register, proof=proof)))
                await self._pump(reader, writer, self._outbox, decoder, connection)
            except _Refused as exc:
                log.error("the gateway at %s:%d refused this worker: %s; retrying in %.0fs",
                          self.host, self.port, exc, opts.rejected_retry_s)
                backoff = opts.rejected_retry_s
            except (OSError, ValueError, TimeoutError, msgspec.DecodeError) as exc:
                log.warning("connection to the gateway at %s:%d lost (%r); reconnecting", self.host, self.port, exc)
            finally:
                self._outbox = None
                self._generation += 1  # drop late sends for the old connection
                self._engine_host.disconnect(connection)
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            if backoff > 0.05:
                await asyncio.sleep(backoff)
                backoff = 0.05

    @staticmethod
    async def _challenge(reader: asyncio.StreamReader, decoder: FrameDecoder) -> WorkerChallenge:
        messages = await read_opening(reader, decoder)
        if not messages:
            raise ConnectionResetError("the gateway closed the connection before its challenge")
        if isinstance(messages[0], WorkerChallenge) and len(messages) == 1:
            return messages[0]
        raise ValueError("the gateway did not open with a challenge")

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    outbox: asyncio.Queue[bytes], decoder: FrameDecoder, connection: _Connection) -> None:
        async def write() -> None:
            while True:
                frame = await outbox.get()
                writer.write(frame)
                while not outbox.empty():  # batch what piled up into one drain
                    writer.write(outbox.get_nowait())
                await writer.drain()

        writer_task = asyncio.create_task(write())
        try:
            while True:
                data = await reader.read(READ_CHUNK_BYTES)
                if not data:
                    return
                for message in decoder.feed(data):
                    if isinstance(message, GenerateRequest):
                        self._engine_host.add(connection, message)
                    elif isinstance(message, AbortRequest):
                        self._engine_host.abort(connection, message.request_id)
                    elif isinstance(message, WorkerRejected):
                        raise _Refused(message.reason)
                if writer_task.done():
                    writer_task.result()
        finally:
            writer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer_task


class _Connection:
    """One connection to a gateway, as a client of the engine host: what the host sends it is
    framed on the engine thread and queued on the IO loop (dropped once the connection is gone)."""

    def __init__(self, link: _GatewayLink, generation: int, loop: asyncio.AbstractEventLoop) -> None:
        self._link = link
        self._generation = generation
        self._loop = loop
        self.kv_events = False  # its gateway asked for KvEvents (set from its challenge)

    def on_deltas(self, deltas: list[RequestDelta]) -> None:
        self._post([encode_frame(delta) for delta in deltas])

    def on_capacity(self, capacity: WorkerCapacity) -> None:
        self._post([encode_frame(capacity)])

    def on_kv_events(self, events: KvEvents) -> None:
        if self.kv_events:
            self._post([encode_frame(events)])

    def on_closed(self, reason: str) -> None:
        pass  # the process exits next; its sockets close with it

    def _post(self, frames: list[bytes]) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed at shutdown
            self._loop.call_soon_threadsafe(self._link.enqueue, self._generation, frames)


class _LinkIO:
    """The IO thread: one asyncio loop running every gateway link."""

    def __init__(self, options: WorkerOptions, host: EngineHost) -> None:
        self._loop = asyncio.new_event_loop()
        context = client_ssl_context(options.tls_ca)
        self.links = [_GatewayLink(address, options, host, context) for address in options.gateways]
        self._main: asyncio.Task[None] | None = None
        self.thread = threading.Thread(target=self._run, name="gateway-io", daemon=True)

    def start(self, register: WorkerRegister) -> None:
        async def run_links() -> None:
            await asyncio.gather(*(link.connect_forever(register) for link in self.links))

        self._main = self._loop.create_task(run_links())
        self.thread.start()

    def stop(self) -> None:
        if self._main is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._main.cancel)
        self.thread.join(timeout=5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            if self._main is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    self._loop.run_until_complete(self._main)
        finally:
            self._loop.close()


class WorkerServer:
    """Runs an LLMEngine's host and serves it to every gateway link until `stop()` (or SIGTERM/SIGINT)."""

    def __init__(self, engine: LLMEngine, options: WorkerOptions) -> None:
        self.engine = engine
        self.options = options
        self.host = EngineHost(engine, options.worker_id, heartbeat_interval_s=options.heartbeat_interval_s)
        self._io = _LinkIO(options, self.host)

    def stop(self) -> None:
        self.host.stop()

    def serve_forever(self) -> None:
        served = ServedModelInfo(name=self.options.model_name, max_model_len=self.engine.max_model_len,
                                 tokenizer=tokenizer_identity(self.engine.config.model))
        register = WorkerRegister(worker_id=self.options.worker_id, models=(served,),
                                  device=str(self.engine.config.device), pid=os.getpid(),
                                  capacity=self.host.capacity())
        self._io.start(register)
        try:
            self.host.run(keep_going=self._parent_alive)
        except Exception:
            # The host failed every request: let the IO thread flush those error deltas, then exit
            # (`sluice serve` restarts the worker) rather than serve from a broken engine.
            time.sleep(0.2)
            raise
        finally:
            self._io.stop()

    def _parent_alive(self) -> bool:
        parent = self.options.parent_pid
        if parent is not None and os.getppid() != parent:
            log.warning("the parent process %d is gone; worker exiting", parent)
            return False
        return True


def run_worker(engine_config: EngineConfig, options: WorkerOptions) -> None:
    """Builds the engine and serves until SIGTERM/SIGINT."""
    from sluice.workers.engine import LLMEngine

    tracing.configure(options.tracing.enabled, options.tracing.otlp_endpoint, "sluice-worker",
                      options.tracing.sample_ratio)
    engine = LLMEngine(engine_config)
    server = WorkerServer(engine, options)

    def _stop(*_: object) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    gateways = ", ".join(f"{host}:{port}" for host, port in options.gateways)
    log.info("worker %s serving %s on %s for the gateway(s) %s", options.worker_id, options.model_name,
             engine_config.device, gateways)
    server.serve_forever()
