"""The chained, tenant-salted hash of prefix-cache blocks, shared by the engine and the gateway.

The engine's block manager (workers/block_manager.py) names each full KV block it caches by
H(parent hash, cache salt, its token ids), so a hash names the whole prefix up to that block and
two tenants (different salts) never share a block. The gateway computes the same hashes from the
prompt token ids it already has (gateway/dispatch/routing.py) and looks them up in its index of
what each worker reported caching (gateway/dispatch/cache_index.py). One function for both, so the
two can never drift apart. No torch here: the gateway installs without it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = bytes(16)  # the parent of a sequence's first block
HASH_BYTES = 16


def hash_block(parent_hash: bytes, cache_salt: str, token_ids: Sequence[int]) -> bytes:
    """Chained, salted hash of one full block (16-byte BLAKE2b: collisions are not a concern)."""
    salt = cache_salt.encode()
    h = hashlib.blake2b(parent_hash, digest_size=HASH_BYTES)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a sequence an engine can reuse from its cache: the last
    token is always computed (the runner needs its logits), so at most (n - 1) // block_size."""
    return max(0, (num_tokens - 1) // block_size)


def prefix_block_hashes(cache_salt: str, token_ids: Sequence[int], block_size: int,
                        num_blocks: int | None = None) -> list[bytes]:
    """The hashes of the first `num_blocks` full blocks of `token_ids` (all cacheable ones when None)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    count = cacheable_blocks(len(token_ids), block_size) if num_blocks is None else num_blocks
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for i in range(count):
        parent = hash_block(parent, cache_salt, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
