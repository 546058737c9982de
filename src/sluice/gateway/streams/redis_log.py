"""The Redis delta log (`RedisStreamLog`): a Redis Stream per response, shared by the replicas
(the interface is `streams/log.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import deque
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.gateway.generation.state import Envelope
from sluice.gateway.streams.local_log import LocalStreamLog
from sluice.gateway.streams.log import (
    DEFAULT_MAX_EVENTS,
    DEFAULT_RETENTION_S,
    Keyed,
    LogTrimmed,
    Mark,
    Page,
    encode_mark,
)

log = logging.getLogger(__name__)

READ_BATCH = 1024  # events per XRANGE / XREAD
EXPIRE_EVERY_S = 5.0  # a live stream's keys have their TTL renewed this often (it is >= 1 s)
MIRROR_LINGER_S = 30.0  # Redis mode: the in-process mirror of an ended response lives this long


def _entry_id(seq: int) -> str:
    return f"0-{seq + 1}"


def _seq(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[1]) - 1


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
        packed = b"" if mark is None else encode_mark(mark)  # first: nothing changes if it fails
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
