"""The delta log of streamed responses: every SSE event a streamed completion sent, kept per
response id for a retention window, so a client that lost its connection can attach again and get
exactly the events after its `Last-Event-ID` (docs/streams.md).

One interface, two stores: `LocalStreamLog` (this process: a bounded dict with expiry) and
`RedisStreamLog` (a Redis Stream per response, shared by the replicas). An event's sequence number
is its position in the response's log (0 first); the Redis entry id is `0-(seq+1)` (entry ids
start above 0-0), so a replay is one XRANGE from the id after the client's last one.

`append` never waits: the Redis store keeps a mirror of the responses pumped in this process (the
live client reads it, no round trip per token) and writes what was appended to Redis in one
pipelined batch per wakeup of its flusher task.

Beside each event's SSE bytes the Redis store keeps a typed checkpoint (`Mark`: the output token
ids first sent with it, its text characters, its finish reason, its kind), and beside each
response its `Envelope`: a replica that takes a stream over (streams/holder.py) rebuilds the
stream's state from those, never from the SSE text. The in-process store has no reader for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.gateway.generation.state import Envelope

log = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 300.0
DEFAULT_MAX_EVENTS = 65_536  # per response: more than any completion of a 64k-token context has
MAX_RESPONSES = 20_000  # in-process: the oldest response is forgotten beyond this many
MAX_BYTES = 256 * 2**20  # in-process: ended responses are forgotten, oldest first, beyond this many event bytes
READ_BATCH = 1024  # events per XRANGE / XREAD
EXPIRE_EVERY_S = 5.0  # a live stream's keys have their TTL renewed this often (it is >= 1 s)
MIRROR_LINGER_S = 30.0  # Redis mode: the in-process mirror of an ended response lives this long


class EventKind(enum.IntEnum):
    CHUNK = 0  # a chunk with choices (text, logprobs, a finish reason)
    USAGE = 1  # the chunk that carries the usage
    DONE = 2  # [DONE]: nothing follows
    ERROR = 3  # an error event: nothing follows


class Mark(msgspec.Struct, frozen=True, array_like=True):
    """What one event adds to its stream's state, typed, beside its SSE bytes (module docstring)."""

    kind: EventKind = EventKind.CHUNK
    tokens: bytes = b""  # the output token ids first sent with this event, packed (`pack_tokens`)
    chars: int = 0  # characters of output text in it
    finish: str | None = None  # the finish reason its choice carries

    @property
    def final(self) -> bool:
        return self.kind in (EventKind.DONE, EventKind.ERROR)


_mark_encode = msgspec.msgpack.Encoder().encode
_mark_decode = msgspec.msgpack.Decoder(Mark).decode
_envelope_decode = msgspec.msgpack.Decoder(Envelope).decode


def decode_mark(data: bytes) -> Mark:
    return _mark_decode(data)


def decode_envelope(data: bytes) -> Envelope:
    return _envelope_decode(data)


class LogTrimmed(Exception):
    """The events right after the client's last one are no longer kept (the log's bound)."""


@dataclass(slots=True)
class Page:
    """Events `first`, `first + 1`, ... of one response, and whether its log ends with them."""

    first: int
    frames: list[bytes]
    ended: bool


@dataclass(frozen=True, slots=True)
class Keyed:
    """What an Idempotency-Key was filed with: its response, and the fingerprint of the request
    that created it ("" when filed without one), so a reuse with another request is told apart."""

    response_id: str
    fingerprint: str = ""

    def encode(self) -> str:
        return f"{self.response_id}|{self.fingerprint}"

    @classmethod
    def decode(cls, value: bytes | str) -> Keyed:
        text = value.decode() if isinstance(value, bytes) else str(value)
        response_id, _, fingerprint = text.partition("|")
        return cls(response_id, fingerprint)


class StreamLog(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    keeps_marks: bool  # whether `append`'s marks are kept (a takeover reads them)

    async def create(self, response_id: str, tenant: str, idempotency_key: str | None, *,
                     grace_s: float | None = None, envelope: Envelope | None = None,
                     fingerprint: str = "") -> Keyed | None:
        """Files a new response of `tenant` (its key, with the `fingerprint` of the request it was
        sent with, and its owner in one atomic step). With a key already filed by this tenant
        (within the retention), files nothing and returns what that key was filed with; else None.
        `grace_s` (its disconnect grace) and `envelope` are kept for a replica that takes it over."""
        ...

    async def drop(self, response_id: str, tenant: str, idempotency_key: str | None) -> None:
        """Undoes `create` (the request was not accepted)."""
        ...

    def append(self, response_id: str, frame: bytes, mark: Mark | None = None) -> None:
        """The next event of a response pumped in this process. Never waits. `mark`: what it adds
        to the stream's state (kept where `keeps_marks`, for a replica that takes the generation
        over: streams/holder.py)."""
        ...

    def end(self, response_id: str) -> None:
        """No event follows; the response is kept for the retention window from now."""
        ...

    async def owner(self, response_id: str) -> str | None:
        """The tenant that created it; None when unknown or expired."""
        ...

    async def by_key(self, tenant: str, idempotency_key: str) -> Keyed | None:
        """What this tenant's key was filed with (within the retention), else None."""
        ...

    async def read(self, response_id: str, after: int, *, wait_s: float) -> Page | None:
        """The events after seq `after` (-1: from the first), waiting up to `wait_s` for one when
        there is none yet. None: unknown or expired. Raises LogTrimmed on a gap."""
        ...

    async def touch_follower(self, response_id: str) -> None:
        """A follower in another process is attached (Redis: it holds off the owner's grace)."""
        ...

    async def followed_elsewhere(self, response_id: str) -> bool: ...


# ---- in this process ----------------------------------------------------------------------------


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


# ---- Redis --------------------------------------------------------------------------------------


def _entry_id(seq: int) -> str:
    return f"0-{seq + 1}"


def _seq(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[1]) - 1


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as an event entry's `t` field (4 bytes each, little-endian)."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def unpack_tokens(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


# KEYS: the response's owner hash P:sm:ID, then its Idempotency-Key's name (when it has one);
# ARGV: what the key is filed with (`Keyed.encode`: response id | request fingerprint), TTL (s),
# the owner's fields and values. Returns what the key was already filed with (nothing filed then),
# else nil.
_CREATE = r"""
if KEYS[2] then
  local known = redis.call('GET', KEYS[2])
  if known then return known end
  redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return false
"""


class RedisStreamLog:
    """P:sl:ID a Redis Stream of the events (field f, and m: its `Mark`, msgpack; the end marker has
    field e only), P:sm:ID its owner (a hash: tenant; gen, the replica generating it; key, the Redis
    key of its Idempotency-Key; grace, its disconnect grace; env, its `Envelope`, msgpack;
    takeovers, streams/holder.py),
    P:sk:TENANT:HASH the Idempotency-Key mapping, P:sf:ID set while a follower on another replica
    is attached. Each expires `retention_s` after the last write to it."""

    FOLLOWER_TTL_S = 3
    keeps_marks = True

    def __init__(
        self,
        client: Redis,
        *,
        prefix: str,
        retention_s: float = DEFAULT_RETENTION_S,
        max_events: int = DEFAULT_MAX_EVENTS,
        replica: str = "",
    ) -> None:
        if not retention_s > 0:
            raise ValueError(f"gateway.stream_retention_s must be positive, got {retention_s}")
        self.replica = replica  # filed as the generator of the responses created here
        self._redis: Any = client  # redis-py's async stubs type replies as Awaitable | value
        self._prefix = prefix
        self.retention_s = retention_s
        self._ttl = max(1, int(retention_s + 0.999))
        self.max_events = max_events
        self._mirror = LocalStreamLog(retention_s=min(retention_s, MIRROR_LINGER_S), max_events=max_events)
        self._next: dict[str, int] = {}  # next seq of each response pumped here
        self._keys: dict[str, str] = {}  # response id -> its Idempotency-Key's Redis key
        self._expired_at: dict[str, float] = {}  # response id -> when its TTLs were last renewed
        # id, seq, frame (None: the end), its packed Mark, when, held back from the mirror
        self._pending: list[tuple[str, int, bytes | None, bytes, float, bool]] = []
        # Events are shown to this process's followers (the mirror) once they are in Redis, so a
        # client never has an event that a replica taking the stream over (gateway/streams/holder.py)
        # cannot see: the taker's events after it would not be the same chunks. In append order.
        # While Redis fails (`_direct`) they are shown at once: the live client is not held up.
        self._unmirrored: deque[tuple[str, bytes | None]] = deque()
        self._direct = False
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._stopping = False
        self.flush_latency_s: deque[float] = deque(maxlen=100_000)  # append -> in Redis, per event
        self._create = client.register_script(_CREATE)

    def _k(self, kind: str, name: str) -> str:
        return f"{self._prefix}:{kind}:{name}"

    def _key_name(self, tenant: str, idempotency_key: str) -> str:
        digest = hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]
        return self._k("sk", f"{tenant}:{digest}")

    async def start(self) -> None:
        if self._flusher is None:
            self._stopping = False
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)
            self._flusher = None

    async def create(self, response_id: str, tenant: str, idempotency_key: str | None, *,
                     grace_s: float | None = None, envelope: Envelope | None = None,
                     fingerprint: str = "") -> Keyed | None:
        name = None if idempotency_key is None else self._key_name(tenant, idempotency_key)
        fields: list[str | bytes] = ["tenant", tenant, "gen", self.replica]
        if name is not None:
            fields += ["key", name]
        if grace_s is not None:
            fields += ["grace", repr(float(grace_s))]
        if envelope is not None:
            fields += ["env", msgspec.msgpack.encode(envelope)]
        # One script: a replica killed between filing the key and the owner must not leave a key
        # whose response has no owner (an attach to it would be a 404).
        keys = [self._k("sm", response_id)] + ([name] if name is not None else [])
        known = await self._create(keys=keys, args=[Keyed(response_id, fingerprint).encode(), self._ttl, *fields])
        if known is not None:
            return Keyed.decode(known)
        if name is not None:
            self._keys[response_id] = name
        await self._mirror.create(response_id, tenant, None)
        self._next[response_id] = 0
        return None

    async def drop(self, response_id: str, tenant: str, idempotency_key: str | None) -> None:
        await self._mirror.drop(response_id, tenant, None)
        self._next.pop(response_id, None)
        names = [self._k("sm", response_id)]
        key = self._keys.pop(response_id, None)
        if key is not None:
            names.append(key)
        await self._redis.delete(*names)

    def adopt(self, response_id: str, tenant: str, first: int, key: str | None) -> None:
        """Continues a response another replica generated up to seq `first - 1` (a takeover,
        gateway/streams/holder.py, which claimed it in P:sm): appends and `end` go on from `first`;
        reads before it go to Redis."""
        self._mirror.adopt(response_id, tenant, first)
        self._next[response_id] = first
        if key:
            self._keys[response_id] = key

    def append(self, response_id: str, frame: bytes, mark: Mark | None = None) -> None:
        seq = self._next.get(response_id)
        if seq is None:
            return
        packed = b"" if mark is None else _mark_encode(mark)  # first: nothing changes if it fails
        self._next[response_id] = seq + 1
        if self._direct:
            self._mirror.append(response_id, frame)
        else:
            self._unmirrored.append((response_id, frame))
        self._pending.append((response_id, seq, frame, packed, time.perf_counter(), not self._direct))
        self._wake.set()

    def end(self, response_id: str) -> None:
        seq = self._next.pop(response_id, None)
        if seq is None:
            return
        if self._direct:
            self._mirror.end(response_id)
        else:
            self._unmirrored.append((response_id, None))
        self._pending.append((response_id, seq, None, b"", time.perf_counter(), not self._direct))
        self._wake.set()

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._pending:
                batch, self._pending = self._pending, []
                await self._write(batch)
            elif self._stopping:
                return

    async def _write(self, batch: list[tuple[str, int, bytes | None, bytes, float, bool]]) -> None:
        """One pipelined round trip for the whole batch, then its events are shown here; a failed
        one is retried once, then its events are missing in Redis (shown here all the same, and
        from then on every event at once, until a write succeeds again)."""
        try:
            written = await self._send(batch)
        finally:
            self._show(sum(held for *_, held in batch))
        if written:
            if self._direct:
                log.info("stream log: the shared store takes events again")
            self._direct = False
        else:
            self._direct = True
            self._show(len(self._unmirrored))  # nothing may wait behind the events shown at once

    def _show(self, count: int) -> None:
        """The oldest `count` events held back are shown to this process's followers."""
        mirror, unmirrored = self._mirror, self._unmirrored
        for _ in range(min(count, len(unmirrored))):
            rid, frame = unmirrored.popleft()
            if frame is None:
                mirror.end(rid)
            else:
                mirror.append(rid, frame)

    async def _send(self, batch: list[tuple[str, int, bytes | None, bytes, float, bool]]) -> bool:
        pipe = self._redis.pipeline(transaction=False)
        touched: dict[str, bool] = {}
        for rid, seq, frame, mark, *_ in batch:
            fields: dict[str, bytes] = {"e": b"1"} if frame is None else {"f": frame}
            if mark:
                fields["m"] = mark
            pipe.xadd(self._k("sl", rid), fields, id=_entry_id(seq), maxlen=self.max_events, approximate=True)  # type: ignore[arg-type]
            touched[rid] = touched.get(rid, False) or frame is None
        now = time.monotonic()
        for rid, ended in touched.items():
            # The TTLs are renewed at the first event, at the end and every EXPIRE_EVERY_S between:
            # three EXPIREs per batch per stream would cost more than the XADDs.
            if not ended and now - self._expired_at.get(rid, -EXPIRE_EVERY_S) < EXPIRE_EVERY_S:
                continue
            self._expired_at[rid] = now
            pipe.expire(self._k("sl", rid), self._ttl)
            pipe.expire(self._k("sm", rid), self._ttl)
            key = self._keys.get(rid)
            if key is not None:
                pipe.expire(key, self._ttl)
            if ended:
                self._keys.pop(rid, None)
                del self._expired_at[rid]
        for attempt in (1, 2):
            try:
                await pipe.execute(raise_on_error=False)
                break
            except (RedisError, OSError) as exc:
                if attempt == 2:
                    log.warning("stream log: %d events not written to the shared store: %s", len(batch), exc)
                    return False
        done = time.perf_counter()
        self.flush_latency_s.extend(done - t for *_, t, _ in batch)
        return True

    async def flushed(self) -> None:
        """Waits until everything appended so far is in Redis (tests, bench)."""
        while self._pending:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0)  # the flusher's batch in flight
        while self._flusher is not None and self._wake.is_set():
            await asyncio.sleep(0.001)

    async def owner(self, response_id: str) -> str | None:
        local = await self._mirror.owner(response_id)
        if local is not None:
            return local
        tenant = await self._redis.hget(self._k("sm", response_id), "tenant")
        return None if tenant is None else tenant.decode()

    async def by_key(self, tenant: str, idempotency_key: str) -> Keyed | None:
        known = await self._redis.get(self._key_name(tenant, idempotency_key))
        return None if known is None else Keyed.decode(known)

    def _page(self, after: int, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> Page:
        frames: list[bytes] = []
        ended = False
        expected = after + 1
        for entry_id, fields in entries:
            seq = _seq(entry_id)
            if seq != expected:
                raise LogTrimmed
            expected += 1
            if b"e" in fields:
                ended = True
                break
            frames.append(fields[b"f"])
        return Page(after + 1, frames, ended)

    async def read(self, response_id: str, after: int, *, wait_s: float) -> Page | None:
        if self._mirror.has(response_id):
            try:
                return await self._mirror.read(response_id, after, wait_s=wait_s)
            except LogTrimmed:  # taken over here (`adopt`): its earlier events are in Redis only
                pass
        key = self._k("sl", response_id)
        entries = await self._redis.xrange(key, min=f"({_entry_id(after)}", count=READ_BATCH)
        if entries or not await self._redis.exists(self._k("sm", response_id)):
            return self._page(after, entries) if entries else None
        # Nothing after `after`: a log that ended at or before it has nothing more to give (as the
        # in-process log answers), rather than a wait for entries that never come until it expires.
        last = await self._redis.xrevrange(key, count=1)
        if last and b"e" in last[0][1] and _seq(last[0][0]) <= after + 1:
            return Page(after + 1, [], True)
        if wait_s > 0:
            reply = await self._redis.xread({key: _entry_id(after)}, count=READ_BATCH, block=int(wait_s * 1000))
            if reply:
                return self._page(after, reply[0][1])
        return Page(after + 1, [], False)

    async def touch_follower(self, response_id: str) -> None:
        if not self._mirror.has(response_id):
            with contextlib.suppress(RedisError, OSError):
                await self._redis.set(self._k("sf", response_id), b"1", ex=self.FOLLOWER_TTL_S)

    async def followed_elsewhere(self, response_id: str) -> bool:
        try:
            return bool(await self._redis.exists(self._k("sf", response_id)))
        except (RedisError, OSError):
            return False
