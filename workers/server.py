"""The worker process: one engine in a busy loop, connected to one or more gateways over TCP.

Two threads. The main thread owns the engine and only steps it; an IO thread runs an asyncio
loop with one link per gateway replica (`--gateway a:p,b:p,...`). Each link connects to its
gateway's worker port (TLS when a CA file is configured), answers the gateway's challenge with a
WorkerRegister carrying the HMAC proof of the shared worker secret (the secret itself never
crosses the wire) and what it serves (name, max length, tokenizer identity), then forwards frames:
GenerateRequest / AbortRequest in (through `inbox`, tagged with the link and its connection),
RequestDelta / WorkerCapacity out. Socket IO never blocks a step, and a step never delays reading
an abort by more than one step.

Many gateways, one engine: the engine thread records, for every request in the engine, the link
and connection it came on (`_owners`). A request's deltas go back only on that connection, so a
stream never crosses replicas; `WorkerCapacity` (on every change and as a heartbeat) goes to every
connected link, each with its own `num_received`: the requests received on that link's current
connection, which its gateway uses to know how many it sent are not yet in the engine. A request
id already in the engine that arrives on another link (or again on the same one) is answered there
with an error final delta; the running request is not touched.

If a link's connection drops, only the requests of that connection are aborted in the engine (its
gateway has already failed or re-queued them); the other links' requests run on. Each link
reconnects with backoff by itself, and a gateway that refused this worker is asked again after
`rejected_retry_s`, so workers outlive any gateway's restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import signal
import ssl
import threading
import time
from dataclasses import dataclass

import msgspec

from sluice.protocol import (
    READ_CHUNK_BYTES,
    AbortRequest,
    FinishReason,
    FrameDecoder,
    GenerateRequest,
    Message,
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

    def __post_init__(self) -> None:
        if not self.gateways:
            raise ValueError("a worker needs at least one gateway address")
        if len(set(self.gateways)) != len(self.gateways):
            raise ValueError("the same gateway address is listed twice")


@dataclass(frozen=True, slots=True)
class _Connected:
    """IO thread → engine thread: link `link` has a new connection (its sequence number)."""

    link: int
    generation: int


@dataclass(frozen=True, slots=True)
class _Disconnected:
    link: int
    generation: int


@dataclass(frozen=True, slots=True)
class _Received:
    """A request or an abort that arrived on connection `generation` of link `link`."""

    link: int
    generation: int
    message: GenerateRequest | AbortRequest


@dataclass(frozen=True, slots=True)
class _Wake:
    """Wakes the engine thread (stop)."""


_Inbox = _Received | _Connected | _Disconnected | _Wake


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

    def __init__(self, index: int, address: Address, options: WorkerOptions, inbox: queue.Queue[_Inbox],
                 context: ssl.SSLContext | None) -> None:
        self.index = index
        self.host, self.port = address
        self._options = options
        self._inbox = inbox
        self._ssl = context
        self._outbox: asyncio.Queue[bytes] | None = None
        self._generation = 0

    def enqueue(self, generation: int, frame: bytes) -> None:
        """On the IO loop: a frame for a connection that is gone is dropped."""
        if self._outbox is not None and generation == self._generation:
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
            self._inbox.put(_Connected(self.index, generation))
            log.info("connected to the gateway at %s:%d", self.host, self.port)
            try:
                decoder = FrameDecoder()
                nonce = await asyncio.wait_for(self._challenge(reader, decoder), 30.0)
                proof = worker_proof(opts.secret, nonce, register.worker_id)
                writer.write(encode_frame(msgspec.structs.replace(register, proof=proof)))
                await self._pump(reader, writer, self._outbox, decoder, generation)
            except _Refused as exc:
                log.error("the gateway at %s:%d refused this worker: %s; retrying in %.0fs",
                          self.host, self.port, exc, opts.rejected_retry_s)
                backoff = opts.rejected_retry_s
            except (OSError, ValueError, TimeoutError, msgspec.DecodeError) as exc:
                log.warning("connection to the gateway at %s:%d lost (%r); reconnecting", self.host, self.port, exc)
            finally:
                self._outbox = None
                self._generation += 1  # drop late sends for the old connection
                self._inbox.put(_Disconnected(self.index, generation))
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            if backoff > 0.05:
                await asyncio.sleep(backoff)
                backoff = 0.05

    @staticmethod
    async def _challenge(reader: asyncio.StreamReader, decoder: FrameDecoder) -> bytes:
        messages = await read_opening(reader, decoder)
        if not messages:
            raise ConnectionResetError("the gateway closed the connection before its challenge")
        if isinstance(messages[0], WorkerChallenge) and len(messages) == 1:
            return messages[0].nonce
        raise ValueError("the gateway did not open with a challenge")

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    outbox: asyncio.Queue[bytes], decoder: FrameDecoder, generation: int) -> None:
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
                    if isinstance(message, GenerateRequest | AbortRequest):
                        self._inbox.put(_Received(self.index, generation, message))
                    elif isinstance(message, WorkerRejected):
                        raise _Refused(message.reason)
                if writer_task.done():
                    writer_task.result()
        finally:
            writer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer_task


class _LinkIO:
    """The IO thread: one asyncio loop running every gateway link."""

    def __init__(self, options: WorkerOptions, inbox: queue.Queue[_Inbox]) -> None:
        self._loop = asyncio.new_event_loop()
        context = client_ssl_context(options.tls_ca)
        self.links = [_GatewayLink(i, address, options, inbox, context) for i, address in enumerate(options.gateways)]
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

    def send(self, link: int, generation: int, message: Message) -> None:
        """Thread-safe; a message for a connection that is gone is dropped."""
        frame = encode_frame(message)
        with contextlib.suppress(RuntimeError):  # loop closed at shutdown
            self._loop.call_soon_threadsafe(self.links[link].enqueue, generation, frame)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            if self._main is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    self._loop.run_until_complete(self._main)
        finally:
            self._loop.close()


@dataclass(slots=True)
class _LinkState:
    """The engine thread's view of one link."""

    generation: int = 0  # its current connection; 0 = none
    received: int = 0  # requests received on that connection (WorkerCapacity.num_received)
    last_capacity: tuple[int, ...] | None = None
    last_sent: float = 0.0


@dataclass(frozen=True, slots=True)
class _Owner:
    """Where a request in the engine came from: its deltas go back there only."""

    link: int
    generation: int


class WorkerServer:
    """Runs an LLMEngine and serves it to every gateway link until `stop()` (or SIGTERM/SIGINT)."""

    def __init__(self, engine, options: WorkerOptions) -> None:  # engine: LLMEngine
        self.engine = engine
        self.options = options
        self._inbox: queue.Queue[_Inbox] = queue.Queue()
        self._io = _LinkIO(options, self._inbox)
        self._stop = threading.Event()
        self._links = [_LinkState() for _ in options.gateways]
        self._owners: dict[str, _Owner] = {}  # every request in the engine, by id

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(_Wake())

    def capacity(self, num_received: int = 0) -> WorkerCapacity:
        return msgspec.structs.replace(self.engine.capacity(self.options.worker_id),
                                       num_received=num_received,
                                       num_preemptions=self.engine.scheduler.stats.num_preemptions)

    def serve_forever(self) -> None:
        served = ServedModelInfo(name=self.options.model_name, max_model_len=self.engine.max_model_len,
                                 tokenizer=tokenizer_identity(self.engine.config.model))
        register = WorkerRegister(worker_id=self.options.worker_id, models=(served,),
                                  device=str(self.engine.config.device), pid=os.getpid(),
                                  capacity=self.capacity())
        self._io.start(register)
        try:
            while not self._stop.is_set():
                if self.options.parent_pid is not None and os.getppid() != self.options.parent_pid:
                    log.warning("the parent process %d is gone; worker exiting", self.options.parent_pid)
                    return
                self._drain(block=not self.engine.has_work)
                if self.engine.has_work:
                    self._step()
                self._maybe_send_capacity()
        finally:
            self._io.stop()

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception:
            # The engine already failed a request that raises alone (see LLMEngine.step); this is
            # the engine itself failing: end every stream, then exit (`sluice serve` restarts the
            # worker) rather than serve from a broken engine.
            log.exception("engine step failed; worker exiting")
            self._fail_all(f"the worker serving this request ({self.options.worker_id}) failed; please retry")
            raise
        self._send_deltas(deltas)

    def _drain(self, *, block: bool) -> None:
        timeout = self.options.heartbeat_interval_s
        try:
            message = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, message: _Inbox) -> None:
        if isinstance(message, _Received):
            state = self._links[message.link]
            if message.generation != state.generation:
                return  # from a connection already gone: its gateway has failed or re-queued it
            owner = _Owner(message.link, message.generation)
            if isinstance(message.message, GenerateRequest):
                state.received += 1
                self._add(owner, message.message)
            elif self._owners.get(message.message.request_id) == owner:  # only the sender may abort
                self.engine.abort(message.message.request_id)
        elif isinstance(message, _Connected):
            self._drop_link(message.link)  # leftovers of an older connection (should be none)
            self._links[message.link] = _LinkState(generation=message.generation)
        elif isinstance(message, _Disconnected) and message.generation == self._links[message.link].generation:
            self._links[message.link].generation = 0
            self._drop_link(message.link)

    def _add(self, owner: _Owner, request: GenerateRequest) -> None:
        rid = request.request_id
        if rid in self._owners:  # from another gateway (ids are unique per gateway), or a resend
            self._reply_error(owner, request, f"request id {rid!r} is already running on this worker")
            return
        try:
            self.engine.add_request(rid, list(request.prompt_token_ids), request.sampling,
                                    priority=int(request.priority), cache_salt=request.cache_salt,
                                    arrival_time=request.arrival_time,
                                    resume_token_ids=request.resume_token_ids)
        except Exception as exc:  # bad prompt for this model, values the engine refuses
            if isinstance(exc, ValueError):  # written for users (SamplingParams.validate, add_request)
                text = str(exc)
            else:
                log.warning("request %s refused by the engine", rid, exc_info=True)
                text = "the worker could not accept this request's parameters"
            self._reply_error(owner, request, text)
            return
        self._owners[rid] = owner

    def _reply_error(self, owner: _Owner, request: GenerateRequest, text: str) -> None:
        self._io.send(owner.link, owner.generation, RequestDelta(
            request_id=request.request_id, finish_reason=FinishReason.ERROR, error=text,
            num_prompt_tokens=len(request.prompt_token_ids)))

    def _drop_link(self, link: int) -> None:
        """Aborts the requests that came on `link` (nobody listens for them any more). Their abort
        deltas are collected at once, before a resend under the same id (the gateway re-queues
        batch work) could be mistaken for them; the other links' deltas of that step go out."""
        dropped = [rid for rid, owner in self._owners.items() if owner.link == link]
        for rid in dropped:
            del self._owners[rid]
            self.engine.abort(rid)
        if dropped:
            self._step()

    def _fail_all(self, text: str) -> None:
        for rid, owner in self._owners.items():
            self._io.send(owner.link, owner.generation, RequestDelta(
                request_id=rid, finish_reason=FinishReason.ERROR, error=text))
        self._owners.clear()
        time.sleep(0.2)  # let the IO thread flush the error deltas before the process exits

    def _send_deltas(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            owner = self._owners.get(delta.request_id)
            if owner is None:
                continue  # an aborted request of a dropped link
            if delta.finish_reason is not None:
                del self._owners[delta.request_id]
            if self._links[owner.link].generation == owner.generation:
                self._io.send(owner.link, owner.generation, delta)

    def _maybe_send_capacity(self) -> None:
        now = time.monotonic()
        base: WorkerCapacity | None = None
        for index, state in enumerate(self._links):
            if not state.generation:
                continue
            if base is None:
                base = self.capacity()
            key = (base.num_running, base.num_waiting, base.free_kv_blocks, state.received, base.num_preemptions)
            if key != state.last_capacity or now - state.last_sent >= self.options.heartbeat_interval_s:
                self._io.send(index, state.generation, msgspec.structs.replace(base, num_received=state.received))
                state.last_capacity, state.last_sent = key, now


def run_worker(engine_config, options: WorkerOptions) -> None:
    """Builds the engine and serves until SIGTERM/SIGINT."""
    from sluice.workers.engine import LLMEngine

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
