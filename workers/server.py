"""The worker process: one engine in a busy loop, connected to the gateway over TCP.

Two threads. The main thread owns the engine and only steps it; an IO thread runs an asyncio
loop that connects to the gateway's worker port (TLS when a CA file is configured), answers the
gateway's challenge with a WorkerRegister carrying the HMAC proof of the shared worker secret (the
secret itself never crosses the wire) and what it serves (name, max length, tokenizer identity),
then forwards frames:
GenerateRequest / AbortRequest in (through `inbox`), RequestDelta / WorkerCapacity out. Socket IO
never blocks a step, and a step never delays reading an abort by more than one step.

If the connection drops, every request of that connection is aborted in the engine (the gateway
has already failed or re-queued them) and the IO thread reconnects with backoff, so workers
outlive a gateway restart. `WorkerCapacity.num_received` counts the requests received on the
current connection; the gateway uses it to know how many it sent are not yet in the engine.
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


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    gateway_host: str
    gateway_port: int
    worker_id: str
    model_name: str
    heartbeat_interval_s: float = 1.0
    reconnect_max_s: float = 2.0
    parent_pid: int | None = None  # exit once this process is gone (workers spawned by `sluice serve`)
    secret: str = ""  # the shared worker secret (from settings / SLUICE_GATEWAY_WORKER_SECRET)
    tls_ca: str = ""  # verify the gateway's certificate against this CA file; "" = plain TCP
    rejected_retry_s: float = 5.0  # a gateway that refused this worker is asked again this much later


@dataclass(frozen=True, slots=True)
class _Connected:
    """IO thread → engine thread: a new connection is up (its sequence number)."""

    generation: int


@dataclass(frozen=True, slots=True)
class _Disconnected:
    generation: int


_Inbox = GenerateRequest | AbortRequest | _Connected | _Disconnected


class _Refused(Exception):
    """The gateway did not accept this worker (its reason: wrong secret, duplicate id, ...)."""


def client_ssl_context(ca_file: str) -> ssl.SSLContext | None:
    if not ca_file:
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"gateway.worker_tls_ca {ca_file!r} cannot be loaded: {exc}") from None


def parse_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT for the gateway's worker address, got {value!r}")
    return host, int(port)


class _GatewayLink:
    """The IO thread: keeps one connection to the gateway and moves frames both ways."""

    def __init__(self, options: WorkerOptions, inbox: queue.Queue[_Inbox]) -> None:
        self._options = options
        self._inbox = inbox
        self._loop = asyncio.new_event_loop()
        self._outbox: asyncio.Queue[bytes] | None = None
        self._generation = 0
        self._register: WorkerRegister | None = None
        self._stopping = False
        self._ssl = client_ssl_context(options.tls_ca)
        self.thread = threading.Thread(target=self._run, name="gateway-io", daemon=True)

    def start(self, register: WorkerRegister) -> None:
        self._register = register
        self._main = self._loop.create_task(self._connect_forever())
        self.thread.start()

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(RuntimeError):  # loop already closed
            self._loop.call_soon_threadsafe(self._main.cancel)
        self.thread.join(timeout=5)

    def send(self, generation: int, message: Message) -> None:
        """Thread-safe; a message for a connection that is gone is dropped."""
        frame = encode_frame(message)
        with contextlib.suppress(RuntimeError):  # loop closed at shutdown
            self._loop.call_soon_threadsafe(self._enqueue, generation, frame)

    def _enqueue(self, generation: int, frame: bytes) -> None:
        if self._outbox is not None and generation == self._generation:
            self._outbox.put_nowait(frame)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            with contextlib.suppress(asyncio.CancelledError):
                self._loop.run_until_complete(self._main)
        finally:
            self._loop.close()

    async def _connect_forever(self) -> None:
        opts = self._options
        backoff = 0.05
        while not self._stopping:
            try:
                reader, writer = await asyncio.open_connection(
                    opts.gateway_host, opts.gateway_port, ssl=self._ssl,
                    server_hostname=opts.gateway_host if self._ssl is not None else None)
            except OSError as exc:
                if isinstance(exc, ssl.SSLError):
                    log.warning("TLS handshake with the gateway failed (%s); retrying", exc.reason)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, opts.reconnect_max_s)
                continue
            backoff = 0.05
            self._generation += 1
            generation = self._generation
            self._outbox = asyncio.Queue()
            self._inbox.put(_Connected(generation))
            log.info("connected to the gateway at %s:%d", opts.gateway_host, opts.gateway_port)
            try:
                decoder = FrameDecoder()
                nonce = await asyncio.wait_for(self._challenge(reader, decoder), 30.0)
                assert self._register is not None  # set by start(); internal invariant
                proof = worker_proof(opts.secret, nonce, self._register.worker_id)
                writer.write(encode_frame(msgspec.structs.replace(self._register, proof=proof)))
                await self._pump(reader, writer, self._outbox, decoder)
            except _Refused as exc:
                log.error("the gateway refused this worker: %s; retrying in %.0fs", exc, opts.rejected_retry_s)
                backoff = opts.rejected_retry_s
            except (OSError, ValueError, TimeoutError, msgspec.DecodeError) as exc:
                log.warning("gateway connection lost (%r); reconnecting", exc)
            finally:
                self._outbox = None
                self._generation += 1  # drop late sends for the old connection
                self._inbox.put(_Disconnected(generation))
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
                    outbox: asyncio.Queue[bytes], decoder: FrameDecoder) -> None:
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
                        self._inbox.put(message)
                    elif isinstance(message, WorkerRejected):
                        raise _Refused(message.reason)
                if writer_task.done():
                    writer_task.result()
        finally:
            writer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer_task


class WorkerServer:
    """Runs an LLMEngine and serves it to the gateway until `stop()` (or SIGTERM/SIGINT)."""

    def __init__(self, engine, options: WorkerOptions) -> None:  # engine: LLMEngine
        self.engine = engine
        self.options = options
        self._inbox: queue.Queue[_Inbox] = queue.Queue()
        self._link = _GatewayLink(options, self._inbox)
        self._stop = threading.Event()
        self._generation = 0  # current connection; 0 = none
        self._received = 0
        self._live: set[str] = set()  # requests of the current connection still in the engine
        self._last_capacity: tuple[int, ...] | None = None
        self._last_sent = 0.0

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(_Disconnected(-1))  # wake the loop

    def capacity(self) -> WorkerCapacity:
        return msgspec.structs.replace(self.engine.capacity(self.options.worker_id),
                                       num_received=self._received,
                                       num_preemptions=self.engine.scheduler.stats.num_preemptions)

    def serve_forever(self) -> None:
        served = ServedModelInfo(name=self.options.model_name, max_model_len=self.engine.max_model_len,
                                 tokenizer=tokenizer_identity(self.engine.config.model))
        register = WorkerRegister(worker_id=self.options.worker_id, models=(served,),
                                  device=str(self.engine.config.device), pid=os.getpid(),
                                  capacity=self.capacity())
        self._link.start(register)
        try:
            while not self._stop.is_set():
                if self.options.parent_pid is not None and os.getppid() != self.options.parent_pid:
                    log.warning("the parent process %d is gone; worker exiting", self.options.parent_pid)
                    return
                self._drain(block=not self.engine.has_work)
                if self.engine.has_work:
                    try:
                        deltas = self.engine.step()
                    except Exception:
                        # The engine already failed a request that raises alone (see LLMEngine.step);
                        # this is the engine itself failing: end every stream, then exit (`sluice
                        # serve` restarts the worker) rather than serve from a broken engine.
                        log.exception("engine step failed; worker exiting")
                        self._fail_all(f"the worker serving this request ({self.options.worker_id}) failed; "
                                       "please retry")
                        raise
                    self._send_deltas(deltas)
                self._maybe_send_capacity()
        finally:
            self._link.stop()

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
        if isinstance(message, GenerateRequest):
            self._received += 1
            self._add(message)
        elif isinstance(message, AbortRequest):
            if message.request_id in self._live:
                self.engine.abort(message.request_id)
        elif isinstance(message, _Connected):
            self._abort_all()  # leftovers of an older connection (should be none)
            self._generation, self._received, self._last_capacity = message.generation, 0, None
        elif isinstance(message, _Disconnected) and message.generation == self._generation:
            self._generation = 0
            self._abort_all()

    def _add(self, request: GenerateRequest) -> None:
        try:
            self.engine.add_request(request.request_id, list(request.prompt_token_ids), request.sampling,
                                    priority=int(request.priority), cache_salt=request.cache_salt,
                                    arrival_time=request.arrival_time)
        except Exception as exc:  # bad prompt for this model, duplicate id, values the engine refuses
            if isinstance(exc, ValueError):  # written for users (SamplingParams.validate, add_request)
                message = str(exc)
            else:
                log.warning("request %s refused by the engine", request.request_id, exc_info=True)
                message = "the worker could not accept this request's parameters"
            self._link.send(self._generation, RequestDelta(
                request_id=request.request_id, finish_reason=FinishReason.ERROR, error=message,
                num_prompt_tokens=len(request.prompt_token_ids)))
            return
        self._live.add(request.request_id)

    def _abort_all(self) -> None:
        for request_id in list(self._live):
            self.engine.abort(request_id)
        if self._live:
            self.engine.step()  # collects the abort deltas; nobody is listening for them
        self._live.clear()

    def _fail_all(self, message: str) -> None:
        for request_id in self._live:
            self._link.send(self._generation, RequestDelta(
                request_id=request_id, finish_reason=FinishReason.ERROR, error=message))
        self._live.clear()
        time.sleep(0.2)  # let the IO thread flush the error deltas before the process exits

    def _send_deltas(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            if delta.finish_reason is not None:
                self._live.discard(delta.request_id)
            if self._generation:
                self._link.send(self._generation, delta)

    def _maybe_send_capacity(self) -> None:
        if not self._generation:
            return
        cap = self.capacity()
        key = (cap.num_running, cap.num_waiting, cap.free_kv_blocks, cap.num_received, cap.num_preemptions)
        now = time.monotonic()
        if key != self._last_capacity or now - self._last_sent >= self.options.heartbeat_interval_s:
            self._link.send(self._generation, cap)
            self._last_capacity, self._last_sent = key, now


def run_worker(engine_config, options: WorkerOptions) -> None:
    """Builds the engine and serves until SIGTERM/SIGINT."""
    from sluice.workers.engine import LLMEngine

    engine = LLMEngine(engine_config)
    server = WorkerServer(engine, options)

    def _stop(*_: object) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("worker %s serving %s on %s", options.worker_id, options.model_name, engine_config.device)
    server.serve_forever()
