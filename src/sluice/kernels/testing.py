"""Random paged batches and error metrics shared by the kernel tests and bench/gpu_suite.py.

Nothing here runs in the serving path; it builds inputs the way the engine lays them out
(scattered block ids, tables padded with 0) so kernels are checked against realistic indexing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from sluice.kernels.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    positions: torch.Tensor  # [T] int64: absolute position of each query token


def make_metadata(
    seqs: Sequence[tuple[int, int]],
    block_size: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    extra_blocks: int = 3,
) -> tuple[AttentionMetadata, torch.Tensor, int]:
    """seqs: (query_len, seq_len) per sequence. Returns (meta, positions, num_blocks).

    Block ids are a random permutation so consecutive pages of one sequence are scattered.
    """
    for q_len, seq_len in seqs:
        if not 0 <= q_len <= seq_len or seq_len < 1:
            raise ValueError(f"need 0 <= query_len <= seq_len and seq_len >= 1, got ({q_len}, {seq_len})")
    blocks_per_seq = [(seq_len + block_size - 1) // block_size for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_per_seq)
    table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    positions: list[int] = []
    next_block = 0
    for b, ((q_len, seq_len), nb) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        ids = perm[next_block : next_block + nb]
        next_block += nb
        table[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
    q_lens = [q_len for q_len, _ in seqs]
    query_start_loc = [0]
    for q_len in q_lens:
        query_start_loc.append(query_start_loc[-1] + q_len)
    seq_lens = [seq_len for _, seq_len in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_host=tuple(query_start_loc),
        seq_lens_host=tuple(seq_lens),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device), num_blocks


def make_paged_batch(
    seqs: Sequence[tuple[int, int]],
    *,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Random q and a random paged K/V cache (every slot filled, not only the used ones).

    Values are drawn on `device` itself, so multi-GB caches for benchmarks are cheap to make.
    """
    meta, positions, num_blocks = make_metadata(seqs, block_size, device, torch.Generator().manual_seed(seed))
    gen = torch.Generator(device=device).manual_seed(seed)
    num_tokens = meta.query_start_loc_host[-1]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device, dtype=torch.float32).to(dtype)

    return PagedBatch(
        q=randn(num_tokens, num_q_heads, head_dim),
        k_cache=randn(*shape),
        v_cache=randn(*shape),
        meta=meta,
        positions=positions,
    )


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in `out` gives +inf so it never passes."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / max(denom, 1e-30)


def tolerance(dtype: torch.dtype) -> float:
    """Relative-error-norm tolerance for a kernel whose inputs/outputs are in `dtype`."""
    return {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}[dtype]


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Within the block, torch.empty / torch.empty_like fill floating tensors with NaN, so an
    output element a kernel forgets to write shows up as NaN instead of stale memory."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def _poison(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **k: _poison(real_empty(*a, **k))  # type: ignore[assignment]
    torch.empty_like = lambda *a, **k: _poison(real_empty_like(*a, **k))  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like
