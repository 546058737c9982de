"""Paged attention for prefill chunks and mixed batches (varlen): Triton kernel + launcher.

One program serves BLOCK_M query tokens of one sequence for one query head. A chunk's new
tokens are already in the cache (rotary_store_kv runs first), so every key comes from paged
K/V: query row i (absolute position seq_len - q_len + i) sees keys 0..its position. The key
range splits in two: keys before the tile's first query position are visible to every row
(no causal mask), the rest up to the tile's last position need the mask; one inner loop
serves both through its CAUSAL flag.

With SKIP_DECODES the kernel leaves single-token sequences to the split-KV decode kernel, so
a mixed batch runs each kind on the kernel built for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.attention import AttentionMetadata
from sluice.kernels.paged_common import (
    LOG2E,
    TileConfig,
    attend_kv_range,
    check_paged_inputs,
    default_tiles,
    dot_flags,
    head_block,
    paged_output,
    paged_strides,
)


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [T, Hq, D]
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    qk_scale,
    head_dim,
    group_size,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # Reversed so the longest sequence's last tiles (the most keys under causality) start first
    # and the final wave of programs is short.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    if SKIP_DECODES:  # noqa: SIM102 - a constexpr branch, resolved at compile time
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // group_size

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_md = mask_m[:, None] & (offs_d[None, :] < head_dim)
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=mask_md, other=0.0
    )
    context_start = seq_len - q_len  # position of the chunk's first token
    q_pos = context_start + offs_m  # [BLOCK_M]; padded rows lie past seq_len and see every key
    first_pos = context_start + tile * BLOCK_M
    last_pos = tl.minimum(first_pos + BLOCK_M, seq_len)  # one past the tile's last real position

    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Keys [0, first_pos): the cached prefix and earlier chunk tokens, visible to every row.
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q, q_pos,
        k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, 0, first_pos,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, head_dim,
        PAGE_SIZE, BLOCK_N, BLOCK_D, False, DOT_PRECISION, UPCAST_DOT,
    )  # fmt: skip
    # Keys [first_pos, last_pos): the diagonal, causally masked.
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q, q_pos,
        k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, first_pos, last_pos,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, head_dim,
        PAGE_SIZE, BLOCK_N, BLOCK_D, True, DOT_PRECISION, UPCAST_DOT,
    )  # fmt: skip
    out = acc / l_i[:, None]
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_md)


def paged_prefill_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    skip_decodes: bool = False,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context.

    skip_decodes=True leaves the rows of single-token sequences untouched (for the decode kernel).
    tiles: launch shape; by default 64x64 tiles on CUDA, 16x16 under the interpreter.
    """
    check_paged_inputs("paged_prefill", q, k_cache, v_cache, meta)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = paged_output("paged_prefill", q, out)
    if meta.num_seqs == 0 or num_tokens == 0:
        return out
    tiles = tiles or default_tiles(q)
    grid = (triton.cdiv(meta.max_query_len, tiles.block_m), meta.num_seqs, num_q_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, out,
        *paged_strides(q, k_cache, v_cache, meta, out),
        scale * LOG2E, head_dim, num_q_heads // num_kv_heads,
        PAGE_SIZE=block_size,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=head_block(head_dim),
        SKIP_DECODES=skip_decodes,
        **dot_flags(q),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
