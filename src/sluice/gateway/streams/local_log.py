"""The in-process delta log (`LocalStreamLog`): a bounded dict of responses with expiry, for a
gateway without Redis (the interface is `streams/log.py`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from sluice.gateway.generation.state import Envelope
from sluice.gateway.streams.log import DEFAULT_MAX_EVENTS, DEFAULT_RETENTION_S, Keyed, LogTrimmed, Mark, Page

log = logging.getLogger(__name__)

MAX_RESPONSES = 20_000  # in-process: the oldest response is forgotten beyond this many
MAX_BYTES = 256 * 2**20  # in-process: ended responses are forgotten, oldest first, beyond this many event bytes


@dataclass(slots=True)
class _Entry:
    tenant: str
    key: str | None
    # A list while events are appended; a tuple once ended: a tuple of bytes drops out of the
    # cycle collector's sight, so the responses kept for resumption (thousands, each with its
    # events) are not walked by every full collection.
    frames: list[bytes] | tuple[bytes, ...] = field(default_factory=list)
    first: int = 0  # seq of frames[0]: the front is trimmed beyond max_events
    size: int = 0  # bytes of the frames kept (the log's byte bound counts them)
    ended: bool = False
    expires: float = float("inf")  # monotonic; set at the end
    # Followers waiting for the next change. Plain futures rather than an Event per change plus an
    # `asyncio.timeout` per wait: this runs once per token of every stream (200 streams on a core).
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    # One timer per entry bounds every wait (not one `call_later` per wait, i.e. per token): it is
    # armed for the earliest deadline asked and, when it fires, releases all waiters then waiting.
    _timer: asyncio.TimerHandle | None = None
    _timer_at: float = 0.0

    def page(self, after: int) -> Page:
        start = after + 1
        if start < self.first:
            raise LogTrimmed
        frames = self.frames[start - self.first :]
        return Page(start, frames if isinstance(frames, list) else list(frames), self.ended)

    def wake(self) -> None:
        if not self.waiters:
            return
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _time_up(self) -> None:
        self._timer = None
        self.wake()

    async def wait(self, wait_s: float) -> None:
        """Until the next `wake`, at most `wait_s` (possibly less: the entry's timer releases every
        waiter at once, so one that came after the earliest deadline's waiter returns early; a
        follower then reads an empty page and waits again)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self.waiters.append(waiter)
        at = loop.time() + wait_s
        if self._timer is None or at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(at, self._time_up)
            self._timer_at = at
        try:
            await waiter
        finally:
            if self.waiters and waiter in self.waiters:  # cancelled: not woken
                self.waiters.remove(waiter)


class LocalStreamLog:
    """A bounded dict of responses; an ended one expires `retention_s` after its end."""

    keeps_marks = False  # no other replica takes its streams over

    def __init__(
        self,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_responses: int = MAX_RESPONSES,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        if not retention_s > 0:
            raise ValueError(f"gateway.stream_retention_s must be positive, got {retention_s}")
        self.retention_s = retention_s
        self.max_events = max_events
        self.max_responses = max_responses
        # Bounded by bytes, not only by responses: 20,000 responses of long outputs were hundreds
        # of MB (issue #36). Past the bound the oldest ended responses are forgotten (a live one
        # is bounded by max_events), their Idempotency-Keys with them.
        self.max_bytes = max_bytes
        self.bytes = 0  # frame bytes of every kept response
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._keys: dict[tuple[str, str], tuple[Keyed, float]] = {}  # (tenant, key) -> (filed, expiry)
        self._swept = 0.0

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def _sweep(self, now: float) -> None:
        if now - self._swept < 1.0 and len(self._entries) < self.max_responses:
            return
        self._swept = now
        for rid in [r for r, e in self._entries.items() if e.expires <= now]:
            self._forget(rid)
        for k in [k for k, (_, exp) in self._keys.items() if exp <= now]:
            del self._keys[k]
        while len(self._entries) >= self.max_responses:
            self._forget(next(iter(self._entries)))

    def _forget(self, response_id: str) -> None:
        """Drops a response, its bytes from the count and its Idempotency-Key (when it still names it)."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self.bytes -= entry.size
        if entry.key is not None:
            known = self._keys.get((entry.tenant, entry.key))
            if known is not None and known[0].response_id == response_id:
                del self._keys[(entry.tenant, entry.key)]

    def _shed(self) -> None:
        """Past `max_bytes`: the oldest ended responses go until the log is back under it."""
        for rid in [r for r, e in self._entries.items() if e.ended]:
            if self.bytes <= self.max_bytes:
                return
            self._forget(rid)

    def _entry(self, response_id: str) -> _Entry | None:
        entry = self._entries.get(response_id)
        if entry is not None and entry.expires <= time.monotonic():
            self._forget(response_id)
            return None
        return entry

    async def create(self, response_id: str, tenant: str, idempotency_key: str | None, *,
                     grace_s: float | None = None, envelope: Envelope | None = None,
                     fingerprint: str = "") -> Keyed | None:
        now = time.monotonic()
        self._sweep(now)
        if idempotency_key is not None:
            known = self._keys.get((tenant, idempotency_key))
            if known is not None and known[1] > now:
                return known[0]
            self._keys[(tenant, idempotency_key)] = (Keyed(response_id, fingerprint), float("inf"))
        self._entries[response_id] = _Entry(tenant, idempotency_key)
        return None

    async def drop(self, response_id: str, tenant: str, idempotency_key: str | None) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        if idempotency_key is None:
            return
        known = self._keys.get((tenant, idempotency_key))
        if known is not None and known[0].response_id == response_id:
            del self._keys[(tenant, idempotency_key)]

    def adopt(self, response_id: str, tenant: str, first: int) -> None:
        """Files a response whose events before seq `first` were logged elsewhere (a takeover)."""
        self._entries[response_id] = _Entry(tenant, None, first=first)

    def append(self, response_id: str, frame: bytes, mark: Mark | None = None) -> None:
        entry = self._entries.get(response_id)
        if entry is None or entry.ended:
            return
        frames = entry.frames
        assert isinstance(frames, list)  # a tuple only once ended
        frames.append(frame)
        entry.size += len(frame)
        self.bytes += len(frame)
        if len(frames) > self.max_events:
            trim = len(frames) - self.max_events
            trimmed = sum(len(f) for f in frames[:trim])
            entry.size -= trimmed
            self.bytes -= trimmed
            del frames[:trim]
            entry.first += trim
        if self.bytes > self.max_bytes:
            self._shed()
        entry.wake()

    def end(self, response_id: str) -> None:
        entry = self._entries.get(response_id)
        if entry is None or entry.ended:
            return
        entry.ended = True
        entry.frames = tuple(entry.frames)
        entry.expires = time.monotonic() + self.retention_s
        if entry.key is not None:
            known = self._keys.get((entry.tenant, entry.key))
            if known is not None and known[0].response_id == response_id:
                self._keys[(entry.tenant, entry.key)] = (known[0], entry.expires)
        entry.wake()

    async def owner(self, response_id: str) -> str | None:
        entry = self._entry(response_id)
        return None if entry is None else entry.tenant

    async def by_key(self, tenant: str, idempotency_key: str) -> Keyed | None:
        known = self._keys.get((tenant, idempotency_key))
        return known[0] if known is not None and known[1] > time.monotonic() else None

    def has(self, response_id: str) -> bool:
        return self._entry(response_id) is not None

    async def read(self, response_id: str, after: int, *, wait_s: float) -> Page | None:
        entry = self._entry(response_id)
        if entry is None:
            return None
        page = entry.page(after)
        if page.frames or page.ended or wait_s <= 0:
            return page
        await entry.wait(wait_s)
        return entry.page(after)

    async def touch_follower(self, response_id: str) -> None:
        return None

    async def followed_elsewhere(self, response_id: str) -> bool:
        return False  # every follower is in this process, and counted by its pump


