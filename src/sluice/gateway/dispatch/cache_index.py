"""What one worker holds in its prefix cache, as the gateway knows it: a bounded set of block hashes.

Each engine link keeps one `CacheIndex`, fed by the `KvEvents` its worker sends once per engine
step (blocks cached and evicted, by the chained, tenant-salted hash of sluice/prefix_hash.py). The
index belongs to the link: a worker that reconnects or restarts gets a new link and so starts
from an empty entry, and a lost worker's entries go with its link. Every replica is linked to
every worker, so each keeps its own index from the same events (no shared-store round trip per
routing decision).

An upstream server sends no events: its index is approximate, filled from the prompts this
gateway sent it (`note_sent`), and forgets the oldest first.

Bounded: at most `max_blocks` hashes per worker; past it the least recently stored are forgotten
(the worker evicts least recently used blocks too, so the two stay close). Memory: one 16-byte
hash (a 49-byte bytes object, 57 allocated) plus its dict slot: 90-110 MB per million blocks
(the table grows in powers of two) (docs/routing.md; tests/unit/dispatch/test_cache_index.py measures it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from sluice.prefix_hash import HASH_BYTES
from sluice.protocol import KvEvents

log = logging.getLogger(__name__)


class CacheIndex:
    """One worker's cached prefix blocks (module docstring). Not thread-safe: the event loop's."""

    def __init__(self, max_blocks: int, *, approximate: bool = False) -> None:
        if max_blocks < 1:
            raise ValueError(f"a cache index needs room for at least one block, got {max_blocks}")
        self.max_blocks = max_blocks
        self.approximate = approximate  # filled from what was sent, not from the worker's events
        self.block_size = 0  # of the worker's blocks (0: nothing known yet)
        # Insertion-ordered: the first key is the least recently stored (forgotten first).
        self._blocks: dict[bytes, None] = {}
        self.num_events = 0
        self.num_rejected = 0  # malformed event batches, logged and ignored

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def apply(self, events: KvEvents) -> bool:
        """Folds one batch of a worker's events in; a malformed batch is logged and ignored (False)."""
        problem = _check(events)
        if problem:
            self.num_rejected += 1
            log.warning("ignored a malformed KV event batch: %s", problem)
            return False
        self.num_events += 1
        if events.cleared or events.block_size != self.block_size:
            self._blocks.clear()  # a new block size names other blocks: nothing known holds
            self.block_size = events.block_size
        for block_hash in events.evicted:
            self._blocks.pop(block_hash, None)
        self._store(events.stored)
        return True

    def note_sent(self, block_size: int, hashes: Sequence[bytes]) -> None:
        """A prompt sent to this worker: it will hold these blocks (an upstream's approximate index,
        and an engine's until its own events confirm or evict them)."""
        if block_size != self.block_size:
            if self._blocks and not self.approximate:
                return  # an engine's own events set its block size; a guess never changes it
            self._blocks.clear()
            self.block_size = block_size
        self._store(hashes)

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` (one sequence's, in order) this worker holds."""
        blocks = self._blocks
        n = 0
        for block_hash in hashes:
            if block_hash not in blocks:
                break
            n += 1
        return n

    def _store(self, hashes: Iterable[bytes]) -> None:
        blocks = self._blocks
        for block_hash in hashes:
            blocks.pop(block_hash, None)  # most recent last
            blocks[block_hash] = None
        over = len(blocks) - self.max_blocks
        if over > 0:
            for block_hash in list(_first(blocks, over)):
                del blocks[block_hash]


def _first(blocks: dict[bytes, None], n: int) -> Iterable[bytes]:
    for i, block_hash in enumerate(blocks):
        if i >= n:
            return
        yield block_hash


def _check(events: KvEvents) -> str:
    """Why a batch cannot be applied ("" when it can)."""
    if events.block_size < 1:
        return f"block_size {events.block_size} is not positive"
    for block_hash in (*events.stored, *events.evicted):
        if len(block_hash) != HASH_BYTES:
            return f"a block hash of {len(block_hash)} bytes (expected {HASH_BYTES})"
    return ""
