"""Block manager: reference counts, salted chained prefix hashes, LRU eviction of cached blocks."""

from __future__ import annotations

import pytest

from sluice.protocol import SamplingParams
from sluice.workers.block_manager import BlockManager, hash_block
from sluice.workers.request import Request

pytestmark = pytest.mark.unit

BS = 4


def make_request(rid: str, tokens: list[int], salt: str = "") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), arrival_time=0.0, cache_salt=salt)


def computed(bm: BlockManager, request: Request, num_tokens: int | None = None) -> Request:
    """Allocate `request` (with any prefix hit), mark it computed and publish its full blocks."""
    hits = bm.find_cached_prefix(request)
    total = request.num_tokens if num_tokens is None else num_tokens
    assert bm.allocate(request, total, hits)
    request.num_computed_tokens = total
    bm.cache_computed_blocks(request)
    return request


def test_allocate_and_free_keep_reference_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))
    assert bm.allocate(a, 10)
    assert len(a.block_ids) == 3  # ceil(10 / 4)
    assert bm.num_free_blocks == 5
    assert all(bm.ref_count(b) == 1 for b in a.block_ids)
    # Growing to 12 tokens still fits the third block; 13 needs a fourth.
    assert bm.allocate(a, 12)
    assert len(a.block_ids) == 3
    assert bm.allocate(a, 13)
    assert len(a.block_ids) == 4
    bm.check_invariants([a])
    bm.free(a)
    assert a.block_ids == []
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_allocate_short_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    assert bm.allocate(a, 8)
    b = make_request("b", list(range(100, 108)))
    assert not bm.allocate(b, 8)  # needs 2, 1 free
    assert b.block_ids == []
    assert bm.num_free_blocks == 1
    bm.check_invariants([a, b])


def test_free_twice_is_detected() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = make_request("a", [1, 2, 3])
    assert bm.allocate(a, 3)
    stolen = list(a.block_ids)
    bm.free(a)
    a.block_ids.extend(stolen)
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(a)


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = computed(bm, make_request("a", list(range(10))))
    b = make_request("b", [*range(8), 77, 78, 79])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:2]  # two full blocks in common; the third differs
    assert bm.allocate(b, b.num_tokens, hits)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert [bm.ref_count(x) for x in b.block_ids] == [2, 2, 1]
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.ref_count(x) for x in b.block_ids] == [1, 1, 1]
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 16


def test_last_prompt_token_is_never_served_from_cache() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    computed(bm, make_request("a", list(range(8))))  # exactly two full blocks
    again = make_request("b", list(range(8)))
    # Both blocks are cached, but only the first may be reused: the last token must be computed.
    assert len(bm.find_cached_prefix(again)) == 1
    longer = make_request("c", list(range(9)))
    assert len(bm.find_cached_prefix(longer)) == 2


def test_only_computed_full_blocks_are_published() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(12)))
    assert bm.allocate(a, 12)
    a.num_computed_tokens = 7  # one full block computed, the second only partly
    bm.cache_computed_blocks(a)
    assert bm.num_cached_blocks == 1
    a.num_computed_tokens = 12
    bm.cache_computed_blocks(a)
    assert bm.num_cached_blocks == 3
    assert len(bm.find_cached_prefix(make_request("b", list(range(13))))) == 3


def test_hashes_chain_over_the_whole_prefix() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    computed(bm, make_request("a", [1, 1, 1, 1, 2, 2, 2, 2, 9]))
    # Same second block, different first block: the second block must not match.
    b = make_request("b", [3, 3, 3, 3, 2, 2, 2, 2, 9])
    assert bm.find_cached_prefix(b) == []
    root = bytes(16)
    assert hash_block(root, "", [2] * 4) != hash_block(hash_block(root, "", [1] * 4), "", [2] * 4)


def test_cache_salt_isolates_tenants() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    tokens = list(range(13))
    computed(bm, make_request("a", tokens, salt="tenant-a"))
    assert bm.find_cached_prefix(make_request("b", tokens, salt="tenant-b")) == []
    assert bm.find_cached_prefix(make_request("c", tokens, salt="")) == []
    assert len(bm.find_cached_prefix(make_request("d", tokens, salt="tenant-a"))) == 3
    # The salt is length-prefixed, so salt/token boundaries cannot be shifted to collide.
    assert hash_block(bytes(16), "ab", [1]) != hash_block(bytes(16), "a", [1])


def test_freed_cached_blocks_stay_reusable_until_evicted() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = computed(bm, make_request("a", list(range(9))))
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 6  # cached blocks count as free
    b = make_request("b", list(range(9)))
    hits = bm.find_cached_prefix(b)
    assert hits == a_blocks[:2]
    assert bm.num_allocatable(hits) == 4  # two of the free blocks are the hits themselves
    assert bm.allocate(b, 9, hits)
    assert b.block_ids[:2] == a_blocks[:2]
    bm.check_invariants([b])


def test_lru_eviction_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = computed(bm, make_request("a", [1] * 4 + [2] * 4 + [0]), num_tokens=8)
    b = computed(bm, make_request("b", [5] * 4 + [6] * 4 + [0]), num_tokens=8)
    a_first, a_second = a.block_ids
    b_first, b_second = b.block_ids
    bm.free(a)  # freed first: evicted first; within a request the tail goes first
    bm.free(b)
    assert bm.num_cached_blocks == 4
    c = make_request("c", list(range(100, 104)))
    assert bm.allocate(c, 4)
    assert c.block_ids == [a_second]
    assert bm.num_cached_blocks == 3
    assert bm.allocate(c, 8)
    assert c.block_ids == [a_second, a_first]
    # a's prefix is gone, b's is still whole.
    assert bm.find_cached_prefix(make_request("a2", [1] * 4 + [2] * 4 + [0])) == []
    assert bm.find_cached_prefix(make_request("b2", [5] * 4 + [6] * 4 + [0])) == [b_first, b_second]
    bm.check_invariants([c])


def test_reuse_refreshes_lru_position() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = computed(bm, make_request("a", [1] * 4 + [0]), num_tokens=4)
    b = computed(bm, make_request("b", [2] * 4 + [0]), num_tokens=4)
    bm.free(a)
    bm.free(b)
    # Hit a's block again and free it: it is now the most recently freed, b's is evicted first.
    a2 = make_request("a2", [1] * 4 + [0])
    hits = bm.find_cached_prefix(a2)
    assert bm.allocate(a2, 4, hits)
    bm.free(a2)
    c = make_request("c", list(range(100, 112)))
    assert bm.allocate(c, 12)  # two plain blocks, then one eviction
    assert bm.find_cached_prefix(make_request("b3", [2] * 4 + [0])) == []
    assert len(bm.find_cached_prefix(make_request("a3", [1] * 4 + [0]))) == 1
    bm.check_invariants([c])


def test_equal_blocks_computed_twice_keep_one_cached_copy() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(9)))
    # Both admitted before either is computed: no hit, two private copies.
    assert bm.allocate(a, 9) and bm.allocate(b, 9)
    for r in (a, b):
        r.num_computed_tokens = 9
        bm.cache_computed_blocks(r)
    assert bm.num_cached_blocks == 2
    bm.free(b)  # b's copies are not in the cache: they return to the plain free list
    bm.check_invariants([a])
    assert bm.find_cached_prefix(make_request("c", list(range(9)))) == a.block_ids[:2]


def test_num_reclaimable_counts_only_blocks_that_would_become_free() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = computed(bm, make_request("a", list(range(9))))
    b = make_request("b", [*range(8), 50])
    hits = bm.find_cached_prefix(b)
    assert bm.allocate(b, 9, hits)
    # Releasing b alone frees only its private third block; releasing both frees all four
    # distinct blocks (two shared, one private to each).
    assert bm.num_reclaimable([b]) == 1
    assert bm.num_reclaimable([a, b]) == 4
    assert bm.num_reclaimable([a, b], keep=a.block_ids[:1]) == 3


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = computed(bm, make_request("a", list(range(9))))
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(make_request("b", list(range(9)))) == []
    bm.free(a)
    bm.check_invariants([])


def test_reset_prefix_cache_forgets_hashes() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = computed(bm, make_request("a", list(range(9))))
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(make_request("b", list(range(9)))) == []
    bm.check_invariants([])
