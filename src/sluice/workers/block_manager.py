"""Paged KV block manager: reference-counted blocks with a salted prefix cache and LRU eviction.

A block holds the KV of `block_size` consecutive tokens of one request. A FULL block whose KV has
been computed gets a chained hash: H(parent hash, cache salt, its token ids), so a hash names the
whole prefix up to that block and two tenants (different salts) never share a block. A freed block
keeps its hash and stays reusable (a prefix-cache hit) until it is evicted, least recently freed
first, to make room for a new allocation. Block ids are indices into the runner's KV tensors.
The hash function is shared with the gateway (sluice/prefix_hash.py).

KV events (`record_events`): each hash published to the cache and each evicted is noted, and
`take_events` hands them over once per step (the engine host sends them to its gateways, which
route requests to the worker holding their prefix: gateway/dispatch/routing.py). Only the last
change of a hash within a step is kept: the gateway needs the state, not the history.

No torch here; the scheduler calls this once per scheduled request per step.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

from sluice.prefix_hash import ROOT_HASH as _ROOT_HASH
from sluice.prefix_hash import hash_block as hash_block
from sluice.workers.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the block manager needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> block id
        # Free blocks without a hash (handed out first) and free blocks with a hash, least
        # recently freed first (evicted in that order).
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.record_events = False
        self._events: dict[bytes, bool] = {}  # hash -> stored (True) or evicted (False), this step
        self._events_cleared = False  # the whole cache was forgotten this step (before `_events`)

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evicted on demand)."""
        return len(self._free_plain) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of `request`'s tokens (read-only lookup).

        At most (num_tokens - 1) // block_size blocks: the last token is always computed, so the
        runner has logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for i in range(max_blocks):
            block_id = self._cached.get(self._request_block_hash(request, i))
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def pending_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the full blocks of `request`'s tokens that it has yet to compute: what its
        prefill will publish to the cache (empty without prefix caching)."""
        if not self.enable_prefix_caching:
            return []
        return [self._request_block_hash(request, i)
                for i in range(request.num_computed_tokens // self.block_size, request.num_tokens // self.block_size)]

    def shares_blocks(self, request: Request, first_block: int, hashes: set[bytes], num: int) -> bool:
        """Whether `request`'s `num` blocks from `first_block` on are all in `hashes` (blocks a
        prefix hit may cover: never the one holding the last token, which is always computed)."""
        last = first_block + num
        if num <= 0 or last > (request.num_tokens - 1) // self.block_size:
            return False
        return all(self._request_block_hash(request, i) in hashes for i in range(first_block, last))

    def num_allocatable(self, hit_block_ids: Sequence[int] = ()) -> int:
        """Free blocks left for new allocations once `hit_block_ids` are taken."""
        reused_free = sum(1 for b in hit_block_ids if self._ref_counts[b] == 0)
        return self.num_free_blocks - reused_free

    def num_reclaimable(self, holders: Iterable[Request], keep: Sequence[int] = ()) -> int:
        """Blocks that releasing all `holders` would add to `num_allocatable(keep)`."""
        releases = Counter(b for r in holders for b in r.block_ids)
        keep_set = set(keep)
        return sum(
            1
            for b, n in releases.items()
            if self._ref_counts[b] == n and b not in keep_set
        )

    # ---- mutations -----------------------------------------------------------------------------

    def allocate(self, request: Request, num_tokens: int, hit_block_ids: Sequence[int] = ()) -> bool:
        """Grow `request.block_ids` to cover `num_tokens` tokens; False (and no change) if short.

        `hit_block_ids` (from `find_cached_prefix`, only for a request holding no block yet)
        become the head of its block table; their reference counts go up.
        """
        total = -(-num_tokens // self.block_size)
        if not hit_block_ids:  # the per-step case: a running request grows by a few tokens
            num_new = total - len(request.block_ids)
            if num_new <= 0:
                return True
            if num_new > len(self._free_plain) + len(self._evictable):
                return False
            for _ in range(num_new):
                request.block_ids.append(self._take_free_block())
            return True
        if request.block_ids:
            raise RuntimeError("cached prefix blocks can only start an empty block table")
        num_new = total - len(hit_block_ids)
        if num_new > self.num_allocatable(hit_block_ids):
            return False
        for block_id in hit_block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1
        request.block_ids.extend(hit_block_ids)
        request.num_committed_blocks = len(hit_block_ids)  # already published
        for _ in range(max(0, num_new)):
            request.block_ids.append(self._take_free_block())
        return True

    def free(self, request: Request) -> None:
        """Release all of `request`'s blocks. Tail blocks go first so they are evicted first:
        a prefix is worth more than its continuation."""
        for block_id in reversed(request.block_ids):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] = count
            if count == 0:
                if self._block_hash[block_id] is None:
                    self._free_plain.append(block_id)
                else:
                    self._evictable[block_id] = None
        request.block_ids.clear()
        request.num_committed_blocks = 0

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the full blocks whose KV is computed (`num_computed_tokens`) for prefix reuse.

        Called after each step, so a cached block always holds valid KV. If an equal block is
        already cached (two equal prompts prefilled at once) ours stays private.
        """
        if not self.enable_prefix_caching:
            return
        # Blocks before num_committed_blocks were handled in earlier steps (or were hits): O(new
        # full blocks) per call, not O(block table).
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_committed_blocks:
            return
        for i in range(request.num_committed_blocks, num_full):
            block_id = request.block_ids[i]
            block_hash = self._request_block_hash(request, i)
            if self._block_hash[block_id] is None and block_hash not in self._cached:
                self._cached[block_hash] = block_id
                self._block_hash[block_id] = block_hash
                if self.record_events:
                    self._events[block_hash] = True
        request.num_committed_blocks = max(request.num_committed_blocks, num_full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change); held blocks stay allocated."""
        for block_id in list(self._evictable):
            self._free_plain.append(block_id)
        self._evictable.clear()
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        if self.record_events:
            self._events.clear()
            self._events_cleared = True

    def take_events(self) -> tuple[list[bytes], list[bytes], bool]:
        """(stored, evicted, cleared) since the last call: `cleared` = forget every earlier hash
        first. Empty when `record_events` is off."""
        if not self._events and not self._events_cleared:
            return [], [], False
        events, cleared = self._events, self._events_cleared
        self._events, self._events_cleared = {}, False
        stored = [h for h, kept in events.items() if kept]
        evicted = [h for h, kept in events.items() if not kept]
        return stored, evicted, cleared

    # ---- internals -----------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        if self._free_plain:
            block_id = self._free_plain.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently freed
            block_hash = self._block_hash[block_id]
            if block_hash is not None:
                del self._cached[block_hash]
                self._block_hash[block_id] = None
                if self.record_events:
                    self._events[block_hash] = False
        self._ref_counts[block_id] = 1
        return block_id

    def _request_block_hash(self, request: Request, index: int) -> bytes:
        """Hash of the request's full block `index`, computed once and memoised on the request."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, request.cache_salt, tokens[i * bs:(i + 1) * bs]))
        return hashes[index]

    def check_invariants(self, holders: Iterable[Request]) -> None:
        """Raise RuntimeError if the bookkeeping disagrees with the block tables of `holders`."""
        expected = Counter(b for r in holders for b in r.block_ids)
        for block_id in range(self.num_blocks):
            if self._ref_counts[block_id] != expected.get(block_id, 0):
                raise RuntimeError(
                    f"block {block_id}: ref count {self._ref_counts[block_id]} but "
                    f"{expected.get(block_id, 0)} holders"
                )
        free_plain = set(self._free_plain)
        if len(free_plain) != len(self._free_plain) or free_plain & self._evictable.keys():
            raise RuntimeError("a block appears twice in the free lists")
        for block_id in range(self.num_blocks):
            is_free = block_id in free_plain or block_id in self._evictable
            if is_free != (self._ref_counts[block_id] == 0):
                raise RuntimeError(f"block {block_id}: free-list membership disagrees with its ref count")
            block_hash = self._block_hash[block_id]
            if block_id in free_plain and block_hash is not None:
                raise RuntimeError(f"block {block_id} has a hash but sits in the plain free list")
            if block_id in self._evictable and block_hash is None:
                raise RuntimeError(f"block {block_id} is evictable without a hash")
            if block_hash is not None and self._cached.get(block_hash) != block_id:
                raise RuntimeError(f"block {block_id}: hash table does not point back to it")
        if len(self._cached) != sum(h is not None for h in self._block_hash):
            raise RuntimeError("hash table and block hashes disagree")
