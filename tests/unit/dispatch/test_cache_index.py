"""The gateway's per-worker prefix-cache index, fed by KV events (torch-free)."""

from __future__ import annotations

import tracemalloc

import pytest

from sluice.gateway.dispatch.cache_index import CacheIndex
from sluice.prefix_hash import prefix_block_hashes
from sluice.protocol import KvEvents

pytestmark = pytest.mark.unit


def hashes(salt: str, n_tokens: int, block_size: int = 4) -> list[bytes]:
    return prefix_block_hashes(salt, list(range(n_tokens)), block_size)


def test_stored_blocks_match_the_longest_prefix_and_evicted_ones_stop_matching() -> None:
    index = CacheIndex(100)
    blocks = hashes("t", 33)  # 8 cacheable blocks of 4
    assert len(blocks) == 8
    assert index.apply(KvEvents(block_size=4, stored=tuple(blocks[:5])))
    assert index.matched_blocks(blocks) == 5
    assert index.apply(KvEvents(block_size=4, evicted=(blocks[2],)))
    assert index.matched_blocks(blocks) == 2  # a gap ends the prefix: later blocks are no use


def test_tenant_salts_name_different_blocks() -> None:
    index = CacheIndex(100)
    index.apply(KvEvents(block_size=4, stored=tuple(hashes("tenant-a", 33))))
    assert index.matched_blocks(hashes("tenant-a", 33)) == 8
    assert index.matched_blocks(hashes("tenant-b", 33)) == 0


def test_cleared_and_a_new_block_size_forget_everything() -> None:
    index = CacheIndex(100)
    index.apply(KvEvents(block_size=4, stored=tuple(hashes("t", 33))))
    index.apply(KvEvents(block_size=4, cleared=True))
    assert len(index) == 0
    index.apply(KvEvents(block_size=4, stored=tuple(hashes("t", 33))))
    index.apply(KvEvents(block_size=8, stored=()))
    assert len(index) == 0 and index.block_size == 8


def test_malformed_batches_are_ignored() -> None:
    index = CacheIndex(100)
    index.apply(KvEvents(block_size=4, stored=tuple(hashes("t", 9))))
    assert not index.apply(KvEvents(block_size=0, stored=(bytes(16),)))
    assert not index.apply(KvEvents(block_size=4, stored=(b"short",)))
    assert index.num_rejected == 2 and len(index) == 2


def test_bounded_the_least_recently_stored_go_first() -> None:
    index = CacheIndex(4)
    blocks = hashes("t", 33)
    index.apply(KvEvents(block_size=4, stored=tuple(blocks[:4])))
    index.apply(KvEvents(block_size=4, stored=(blocks[0],)))  # refreshed: now the most recent
    index.apply(KvEvents(block_size=4, stored=tuple(blocks[4:6])))
    assert len(index) == 4
    assert blocks[0] in index and blocks[1] not in index and blocks[2] not in index
    assert all(b in index for b in blocks[3:6])


def test_an_upstreams_approximate_index_is_filled_from_what_was_sent() -> None:
    index = CacheIndex(100, approximate=True)
    index.note_sent(16, hashes("t", 65, 16))
    assert index.block_size == 16 and index.matched_blocks(hashes("t", 65, 16)) == 4


def test_memory_per_million_blocks_is_what_the_docs_say() -> None:
    """docs/routing.md states 90-110 MB per million blocks (hash objects and table); measured on 200k."""
    index = CacheIndex(300_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    batch = tuple(i.to_bytes(16, "little") for i in range(200_000))
    index.apply(KvEvents(block_size=16, stored=batch))
    del batch
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_million_mb = (after - before) * 5 / 1e6
    assert 60 < per_million_mb < 120
