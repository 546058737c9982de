"""A vLLM upstream's own KV events, read into the gateway's exact index of what it caches.

vLLM publishes every change of its prefix cache when run with `--kv-events-config` (publisher
"zmq"): multipart messages (topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`) on a
ZMQ PUB socket. An upstream whose `kv_events_endpoint` is set gets an `UpstreamKvEvents` reader
that subscribes to it; its `CacheIndex` is then exact, like a worker process's, instead of the
approximate one filled from what this gateway sent (docs/routing.md).

vLLM names blocks by its own hashes, which the gateway cannot compute (their seed is the server's).
Each stored block's event carries its token ids, its parent's hash and, on a sequence's first block,
the request's `cache_salt` (sluice sends the tenant's salt with every request), so `Translator`
re-hashes the chain with sluice's own function (sluice/prefix_hash.py) and remembers vLLM hash ->
sluice hash, bounded like the index. Evictions are translated through that map.

Nothing from the server is trusted unchecked: a message that does not decode, a batch with more
than `MAX_EVENTS` events, a stored event whose token count is not its blocks times its block size,
a hash that is neither bytes nor an integer: that event (or message) is skipped, counted and logged
once in a while, and the subscription goes on. A block whose parent is unknown (stored before this
gateway subscribed, or forgotten) cannot be named, so it and its descendants stay out of the index.
A gap in the sequence numbers (messages lost: ZMQ PUB drops under pressure), a sequence that starts
over (the server restarted) or a lost connection empties the index: what it held is no longer known.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from sluice.gateway.dispatch.cache_index import CacheIndex
from sluice.prefix_hash import ROOT_HASH, hash_block
from sluice.protocol import KvEvents

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 2**20  # a larger message is dropped by ZMQ itself (ZMQ_MAXMSGSIZE)
MAX_EVENTS = 65_536  # events in one batch, at most
MAX_HASH_BYTES = 64  # vLLM's hashes are 32-byte digests (or 64-bit integers in older releases)
LOG_EVERY_S = 60.0  # a misbehaving publisher is logged at most this often


# The publisher's wire format, as far as the gateway reads it (unknown fields are ignored, so newer
# releases that add fields still decode). Hashes are bytes (vLLM >= 0.10) or integers (older).
class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode

# A hash as the map keys it: bytes as they are, an integer by its decimal text (never equal to a
# 32-byte digest).
HashKey = bytes


def _key(block_hash: bytes | int) -> HashKey:
    if isinstance(block_hash, int):
        return b"i%d" % block_hash
    if not 0 < len(block_hash) <= MAX_HASH_BYTES:
        raise ValueError(f"a block hash of {len(block_hash)} bytes")
    return block_hash


class Translator:
    """vLLM's block hashes -> sluice's (module docstring); bounded at `max_blocks` entries."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        # vLLM hash -> (sluice hash, the sequence's salt); insertion-ordered, oldest forgotten first.
        self._names: OrderedDict[HashKey, tuple[bytes, str]] = OrderedDict()
        self.num_skipped = 0  # events that could not be read or named
        self.problem = ""  # the last reason one was skipped

    def __len__(self) -> int:
        return len(self._names)

    def clear(self) -> None:
        self._names.clear()

    def translate(self, batch: KVEventBatch, block_size: int) -> KvEvents | None:
        """The batch in sluice's terms (None: nothing in it the index can use); `block_size`: the
        index's, for a batch that stores nothing."""
        if len(batch.events) > MAX_EVENTS:
            self._skip(f"a batch of {len(batch.events)} events (at most {MAX_EVENTS})")
            return None
        stored: list[bytes] = []
        evicted: list[bytes] = []
        cleared = False
        stored_size = 0
        for event in batch.events:
            try:
                if isinstance(event, AllBlocksCleared):
                    self._names.clear()
                    stored.clear()
                    evicted.clear()
                    cleared = True
                elif isinstance(event, BlockRemoved):
                    for block_hash in event.block_hashes:
                        named = self._names.pop(_key(block_hash), None)
                        if named is not None:
                            evicted.append(named[0])
                elif stored_size and event.block_size != stored_size:
                    self._skip(f"block sizes {stored_size} and {event.block_size} in one batch")
                else:
                    hashes = self._store(event)
                    if hashes:
                        stored_size = event.block_size
                        stored.extend(hashes)
            except ValueError as exc:
                self._skip(str(exc))
        if not (stored or evicted or cleared):
            return None
        return KvEvents(block_size=stored_size or block_size or 1, stored=tuple(stored), evicted=tuple(evicted),
                        cleared=cleared)

    def _store(self, event: BlockStored) -> list[bytes]:
        size = event.block_size
        if size < 1 or len(event.token_ids) != size * len(event.block_hashes):
            raise ValueError(f"{len(event.token_ids)} token ids for {len(event.block_hashes)} blocks of {size}")
        if event.lora_name is not None or event.lora_id is not None:
            return []  # an adapter's blocks: sluice sends no adapter requests, and cannot name them
        if event.parent_block_hash is None:
            parent, salt = ROOT_HASH, _salt(event.extra_keys)
        else:
            known = self._names.get(_key(event.parent_block_hash))
            if known is None:
                return []  # stored before we subscribed, or forgotten: its prefix cannot be named
            parent, salt = known
        names = self._names
        hashes: list[bytes] = []
        for i, block_hash in enumerate(event.block_hashes):
            key = _key(block_hash)
            parent = hash_block(parent, salt, event.token_ids[i * size:(i + 1) * size])
            names.pop(key, None)
            names[key] = (parent, salt)
            hashes.append(parent)
        while len(names) > self.max_blocks:
            names.popitem(last=False)
        return hashes

    def _skip(self, problem: str) -> None:
        self.num_skipped += 1
        self.problem = problem


def _salt(extra_keys: list[list[Any] | None] | None) -> str:
    """The cache salt of a sequence's first block: its extra keys are exactly (salt,) for a text
    request with a salt; none for one without (vLLM then salts nothing: "")."""
    first = extra_keys[0] if extra_keys else None
    if not first:
        return ""
    if len(first) == 1 and isinstance(first[0], str):
        return first[0]
    raise ValueError("a first block with extra keys other than a cache salt (multimodal or adapter)")


class UpstreamKvEvents:
    """Subscribes to one vLLM server's KV events and keeps `index` exact (module docstring)."""

    def __init__(self, endpoint: str, topic: str, index: CacheIndex, *, name: str) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.index = index
        self.translator = Translator(index.max_blocks)
        self.num_messages = 0
        self.num_resets = 0  # the index emptied: a gap, a restart or a lost connection
        self._name = name
        self._next_seq: int | None = None
        self._logged_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events-{self._name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def reset(self) -> None:
        """Nothing the index holds is known any more (the server restarted, messages were lost)."""
        self.num_resets += 1
        self.translator.clear()
        self.index.apply(KvEvents(block_size=self.index.block_size or 1, cleared=True))
        self._next_seq = None

    def receive(self, frames: list[bytes]) -> None:
        """One multipart message: (topic, sequence number, payload)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._complain(f"a message of {len(frames)} parts")
            return
        seq = int.from_bytes(frames[1], "big")
        if self._next_seq is not None and seq != self._next_seq:
            self.reset()  # lost messages, or a restarted server counting from 0 again
        self._next_seq = seq + 1
        try:
            batch = _decode_batch(frames[2])
        except (msgspec.DecodeError, ValueError) as exc:
            self._complain(f"an undecodable batch ({exc})")
            return
        self.num_messages += 1
        events = self.translator.translate(batch, self.index.block_size)
        if events is not None:
            self.index.apply(events)
        if self.translator.problem:
            self._complain(self.translator.problem)
            self.translator.problem = ""

    async def _run(self) -> None:
        context = zmq.asyncio.Context.instance()
        while True:
            socket = context.socket(zmq.SUB)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            # A ZMQ connect never fails for a server that is down: it retries in the background;
            # the heartbeat tells a silent publisher from a dead one.
            socket.setsockopt(zmq.HEARTBEAT_IVL, 2000)
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
            monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                socket.connect(self.endpoint)
                await self._read(socket, monitor)
            except zmq.ZMQError as exc:
                self._complain(f"the subscription failed ({exc})")
                await asyncio.sleep(1.0)
            finally:
                socket.disable_monitor()
                monitor.close(linger=0)
                socket.close(linger=0)
            self.reset()

    async def _read(self, socket: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Until the connection drops (the monitor reports it)."""
        disconnected = asyncio.ensure_future(monitor.recv_multipart())
        try:
            while True:
                message = asyncio.ensure_future(socket.recv_multipart())
                done, _ = await asyncio.wait({message, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if message in done:
                    self.receive(message.result())
                if disconnected in done:
                    message.cancel()
                    return
        finally:
            disconnected.cancel()

    def _complain(self, problem: str) -> None:
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.warning("upstream %s: skipped KV events: %s", self._name, problem)
