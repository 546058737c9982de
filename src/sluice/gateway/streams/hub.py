"""Streamed responses that outlive their connection (docs/streams.md).

A streamed completion is not generated inside its HTTP response: a *pump* (one per stream running
in this process, found through its flight in `GenerationService.flights`) frames each delta within
its delivery (streams/frames.py) and appends the events to the stream log, each with its `Mark`;
every client, the one that sent the POST as well as any that attach later (`GET .../{id}/events`,
or the POST re-sent with its `Idempotency-Key`), is a *follower* that reads the log after its
`Last-Event-ID` and writes each event, with `id: <response id>:<seq>` when the client opted in to
resuming (`resumable`), else as one `data:` line (strict SSE clients, e.g. `vllm bench serve`).

When the last follower of a running response goes away, its pump starts the disconnect grace: if
no follower attaches (here, or on another replica: `StreamLog.followed_elsewhere`) within
`gateway.disconnect_grace_s`, the pump is cancelled, which aborts the request as a disconnect
always did (the worker frees its KV blocks, the quota hold is settled). A request sent with
`X-Sluice-Disconnect: abort` has no grace.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from sluice.gateway.cluster.invalidation import Change
from sluice.gateway.edge.errors import OpenAIError, bad_request
from sluice.gateway.generation.flight import Flight, RequestTimedOut
from sluice.gateway.generation.state import RequestTable
from sluice.gateway.streams.frames import DONE, Framer, sse
from sluice.gateway.streams.log import EventKind, LogTrimmed, Mark, StreamLog, pack_tokens
from sluice.protocol import FinishReason, RequestDelta

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0
FIRST_ATTACH_S = 10.0  # the POST's own follower must start within this long (or the grace, if longer)
FOLLOW_WAIT_S = 1.0  # one blocking read of the log (under the Redis client's 2 s socket timeout)
MAX_KEY_CHARS = 255


def _ending(message: str, code: str) -> bytes:
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


ABANDONED = _ending("The stream was stopped: its client went away and none attached within the grace window.",
                    "stream_abandoned")
INTERRUPTED = _ending("The stream was stopped: the gateway replica generating it shut down before it ended.",
                      "stream_interrupted")
LOST = _ending("The stream's log expired or was lost before it ended.", "stream_lost")
TENANT_DISABLED = _ending("The stream was stopped: its tenant was disabled.", "tenant_disabled")
KEYS_REVOKED = _ending("The stream was stopped: its tenant's last API key was revoked.", "key_revoked")


def parse_last_event_id(value: str | None, response_id: str | None) -> tuple[str | None, int]:
    """`<response id>:<seq>` -> (response id, seq); no header -> (None, -1). 400 when malformed
    or (with `response_id`) naming another response."""
    if value is None or value == "":
        return None, -1
    rid, sep, seq = value.rpartition(":")
    if not sep or not rid or not (seq.isascii() and seq.isdigit()) or len(seq) > 12:  # "²" is a digit to isdigit
        raise bad_request("Last-Event-ID must be '<response id>:<sequence number>' as sent in an event's id.", None)
    if response_id is not None and rid != response_id:
        raise bad_request("Last-Event-ID names another response than the one asked for.", None)
    return rid, int(seq)


def check_idempotency_key(value: str | None) -> str | None:
    if value is None:
        return None
    if not 0 < len(value) <= MAX_KEY_CHARS or not value.isascii() or not value.isprintable():
        raise bad_request(f"Idempotency-Key must be 1 to {MAX_KEY_CHARS} printable ASCII characters.", None)
    return value


def wants_ids(resumable: str | None, idempotency_key: str | None) -> bool:
    """Whether a POST's events carry `id:` lines: only for a client that resumes (docs/streams.md),
    which says so with `X-Sluice-Resumable: 1` or by sending an `Idempotency-Key` (unless it sends
    `X-Sluice-Resumable: 0`). Strict SSE
    parsers (each event one `data:` line) choke on them, so `data:`-only is the default."""
    if resumable is None:
        return idempotency_key is not None
    value = resumable.strip().lower()
    if value not in ("0", "1", "false", "true"):
        raise bad_request("X-Sluice-Resumable must be '1' or '0'.", None)
    return value in ("1", "true")  # an explicit '0' wins over the key


def disconnect_grace(header: str | None, default_s: float) -> float:
    """`X-Sluice-Disconnect`: absent or `grace` -> the setting; `abort` -> 0 (abort at once);
    `grace=<seconds>` -> that, at most the setting (a client may shorten its grace, not lengthen it)."""
    value = "grace" if header is None else header.strip().lower()
    if value == "grace":
        return default_s
    if value == "abort":
        return 0.0
    name, sep, seconds = value.partition("=")
    if name.strip() == "grace" and sep:
        try:
            grace_s = float(seconds)
        except ValueError:
            grace_s = -1.0
        if 0 <= grace_s < float("inf"):
            return min(grace_s, default_s)
    raise bad_request("X-Sluice-Disconnect must be 'abort', 'grace' or 'grace=<seconds>'.", None)


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"No stream {response_id!r}: unknown, expired, or not yours.",
        type="invalid_request_error",
        code="stream_not_found",
    )


class _Pump:
    """One streamed response of this process: its flight's events into the log, its followers here."""

    def __init__(self, hub: StreamHub, flight: Flight, framer: Framer, grace_s: float) -> None:
        self.hub = hub
        self.flight = flight
        self.framer = framer
        self.response_id = flight.request_id
        self.grace_s = grace_s
        self.followers = 0
        self.done = False
        self.ending = ABANDONED  # the log's last event when the pump is cancelled
        self.task: asyncio.Future[None] | None = None
        self._started = False  # `run` has begun (a task cancelled before that would skip it whole)
        self._cancel_on_start = False
        self._timer: asyncio.TimerHandle | None = None
        self._arm(max(grace_s, FIRST_ATTACH_S))  # until the POST's own follower starts

    def begin(self) -> None:
        """In the caller's call: the events that exist already (the opening, the deltas that came)
        are logged before the POST's response starts; the rest as each delta is delivered."""
        opening = self.framer.opening()
        if opening is not None:
            self.emit(opening, 0, None)
        self.flight.listen(self._on_delta)

    def _on_delta(self, delta: RequestDelta) -> None:
        if delta.finish_reason is FinishReason.ERROR:
            self._log(self.framer.error(), EventKind.ERROR)
            return
        self.framer.frames(delta, self.emit)
        if delta.finish_reason is not None:
            usage = self.framer.usage()
            if usage is not None:
                self._log(usage, EventKind.USAGE)

    def emit(self, frame: bytes, chars: int, finish: str | None) -> None:
        """One chunk into the log, with the output token ids not logged yet (a delta's go with its
        first event; those of a delta that made no event, e.g. text a tool-call parser still holds, with the next)."""
        if self.done:
            return
        state = self.flight.state
        if self.hub.log.keeps_marks:
            tokens = state.unlogged_tokens()
            # Packed before anything changes: an id that does not pack raises here, with the log,
            # its readers and the state as they were (the pump ends this stream with an error).
            mark = Mark(EventKind.CHUNK, pack_tokens(tokens) if tokens else b"", chars, finish)
            self.hub.log.append(self.response_id, frame, mark)
            state.logged()
        else:
            self.hub.log.append(self.response_id, frame)

    def _log(self, frame: bytes, kind: EventKind) -> None:
        if not self.done:
            self.hub.log.append(self.response_id, frame, Mark(kind))

    async def run(self) -> None:
        """Until the stream ends: [DONE] after the quota is settled (the client's next request finds
        this one ended), or an error event; on cancellation (grace over, shutdown) the request is
        aborted at its worker and the log ends with `ending`."""
        self._started = True
        if self._cancel_on_start and self.task is not None:
            self.task.cancel()  # delivered at the first wait, within the cleanup's reach
        flight = self.flight
        aborted = True
        try:
            try:
                await flight.ended()
            except RequestTimedOut as exc:  # after the first byte: an error event ends the stream
                self._log(Framer.failed(exc), EventKind.ERROR)
                return  # `aborted` stays set: the request is stopped at its worker
            aborted = False
            if flight.state.finish_reason == "error":
                return  # its error event is logged
            flight.finish()
            await flight.settled()
            self._log(DONE, EventKind.DONE)
        except asyncio.CancelledError:
            self._log(self.ending, EventKind.ERROR)
        except Exception:  # a delta that could not be framed: this stream alone ends, with an error
            log.exception("stream %s: its events could not be written", self.response_id)
            self._log(self.framer.error(), EventKind.ERROR)
        finally:
            flight.finish(aborted=aborted and flight.state.finish_reason is None)
            self.done = True  # nothing more is logged (an abort's late final delta included)
            self._disarm()
            try:
                await flight.settled()  # the log ends after its usage is written (a taker records it again)
            except asyncio.CancelledError:
                pass  # cancelled again (shutdown) while waiting: the log still ends
            finally:
                self.hub.log.end(self.response_id)
                flight.pump = None

    def attach(self) -> None:
        self.followers += 1
        self._disarm()

    def detach(self) -> None:
        self.followers -= 1
        if self.followers == 0 and not self.done:
            self._arm(self.grace_s)

    def _arm(self, delay_s: float) -> None:
        self._disarm()
        if delay_s <= 0:
            self._abandon()
        else:
            self._timer = asyncio.get_running_loop().call_later(delay_s, self._grace_over)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _grace_over(self) -> None:
        self._timer = None
        if self.followers == 0 and not self.done:
            self.hub.spawn(self._check_elsewhere())

    async def _check_elsewhere(self) -> None:
        if await self.hub.log.followed_elsewhere(self.response_id):
            if self.followers == 0 and not self.done:
                self._arm(max(self.grace_s, 1.0))  # a follower on another replica holds it
            return
        if self.followers == 0 and not self.done:
            self._abandon()

    def _abandon(self) -> None:
        log.info("stream %s: no client within its grace (%gs); aborting", self.response_id, self.grace_s)
        self.cancel()

    def cancel(self) -> None:
        """Stops the generation. A task cancelled before its first step never runs `run`, so its
        cleanup (the abort at the worker, the log's end) would be skipped: a task not started yet
        is let start and cancels itself."""
        if self._started and self.task is not None:
            self.task.cancel()
        else:
            self._cancel_on_start = True


class StreamHub:
    """The streamed responses pumped in this process, and the followers of any response."""

    def __init__(
        self,
        stream_log: StreamLog,
        flights: RequestTable[Flight],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Future[None] | None],
        *,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        if grace_s < 0:
            raise ValueError(f"gateway.disconnect_grace_s must be zero or positive, got {grace_s}")
        self.log = stream_log
        self.flights = flights
        self.spawn = spawn
        self.grace_s = grace_s

    def pump(self, response_id: str) -> _Pump | None:
        flight = self.flights.get(response_id)
        return None if flight is None else flight.pump

    def start(self, flight: Flight, framer: Framer, grace_s: float) -> None:
        """Generation of `flight` now runs on its own; its events go to the log (already created)."""
        pump = _Pump(self, flight, framer, grace_s)
        flight.pump = pump
        pump.begin()  # the events that exist already are logged before the task runs
        pump.task = asyncio.ensure_future(pump.run())
        self.spawn(self._await(pump.task))  # shutdown waits for it (GenerationService.drain)

    @staticmethod
    async def _await(task: asyncio.Future[None]) -> None:
        await asyncio.gather(task, return_exceptions=True)

    async def stop(self) -> None:
        """At shutdown (or a drain's timeout): streams cannot outlive the process, so each is
        aborted (as a disconnect was before there was a grace); their logs end with
        `stream_interrupted`."""
        pumps = [flight.pump for flight in self.flights if flight.pump is not None]
        for pump in pumps:
            pump.ending = INTERRUPTED
            pump.cancel()
        await asyncio.gather(*(p.task for p in pumps if p.task is not None), return_exceptions=True)

    def on_change(self, change: Change) -> None:
        """The invalidation bus (any replica's admin change): a tenant disabled or deleted, or its
        last key revoked, stops its streams pumped here."""
        if change.kind == "tenant_disabled":
            self.stop_tenant(change.ident, TENANT_DISABLED)
        elif change.kind == "keys_revoked":
            self.stop_tenant(change.ident, KEYS_REVOKED)

    def stop_tenant(self, tenant_id: str, ending: bytes = TENANT_DISABLED) -> None:
        """Its streams pumped here stop now, at the next step, their logs ending with `ending` (an
        error event); what they generated until then is billed as any aborted stream."""
        pumps = [f.pump for f in self.flights if f.pump is not None and f.state.request.tenant_id == tenant_id]
        for pump in pumps:
            pump.ending = ending
            pump.cancel()
        if pumps:
            log.info("tenant %s stopped: %d stream(s) ended", tenant_id, len(pumps))

    async def check_owner(self, response_id: str, tenant: str, after: int) -> None:
        """404 unless `tenant` created it and it is kept; 410 when the events after `after` are trimmed."""
        if await self.log.owner(response_id) != tenant:
            raise not_found(response_id)
        try:
            page = await self.log.read(response_id, after, wait_s=0)
        except LogTrimmed:
            raise OpenAIError(
                410, "The events after that Last-Event-ID are no longer kept.", code="stream_events_trimmed"
            ) from None
        if page is None:
            raise not_found(response_id)

    async def follow(self, response_id: str, after: int, *, with_ids: bool = True) -> AsyncGenerator[bytes, None]:
        """The response's SSE events after seq `after`, live until its log ends; each with its
        `id:` line when `with_ids`, else the logged `data:` event alone."""
        pump = self.pump(response_id)
        if pump is not None:
            pump.attach()
        prefix = b"id: " + response_id.encode() + b":"
        try:
            while True:
                try:
                    page = await self.log.read(response_id, after, wait_s=FOLLOW_WAIT_S)
                except LogTrimmed:
                    page = None
                if page is None:
                    yield LOST
                    return
                if page.frames and not with_ids:
                    after = page.first + len(page.frames) - 1
                    yield b"".join(page.frames)
                elif page.frames:
                    seq = page.first
                    out = []
                    for frame in page.frames:
                        out.append(b"%s%d\n%s" % (prefix, seq, frame))
                        seq += 1
                    after = seq - 1
                    yield b"".join(out)
                if page.ended:
                    return
                if pump is None:
                    await self.log.touch_follower(response_id)
        finally:
            if pump is not None:
                pump.detach()


__all__ = ["StreamHub", "check_idempotency_key", "disconnect_grace", "not_found", "parse_last_event_id", "wants_ids"]
