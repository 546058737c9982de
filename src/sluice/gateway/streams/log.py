"""The delta log of streamed responses: every SSE event a streamed completion sent, kept per
response id for a retention window, so a client that lost its connection can attach again and get
exactly the events after its `Last-Event-ID` (docs/streams.md).

One interface (here), two stores: `LocalStreamLog` (streams/local_log.py: this process, a bounded
dict with expiry) and `RedisStreamLog` (streams/redis_log.py: a Redis Stream per response, shared
by the replicas). An event's sequence number
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

import enum
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from sluice.gateway.generation.state import Envelope

log = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 300.0
DEFAULT_MAX_EVENTS = 65_536  # per response: more than any completion of a 64k-token context has


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


_mark_encoder = msgspec.msgpack.Encoder()
_mark_decode = msgspec.msgpack.Decoder(Mark).decode
_envelope_decode = msgspec.msgpack.Decoder(Envelope).decode


def encode_mark(mark: Mark) -> bytes:
    return _mark_encoder.encode(mark)


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


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as an event entry's `t` field (4 bytes each, little-endian)."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def unpack_tokens(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))

