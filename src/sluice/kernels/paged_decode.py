"""Paged attention for decode tokens with split-KV ("flash-decoding"): Triton kernels + launcher.

Each program serves one (sequence, KV head, context partition) and all the query heads that
share that KV head (GQA packing: the group's query heads are the rows of one tile, so each
K/V tile is read once per group rather than once per query head). With few long sequences,
splitting the context into partitions gives the GPU enough programs; each partition writes a
normalised partial output with its max and sum, and a reduce kernel combines them:
  out = sum_p exp2(m_p - M) * l_p * o_p / sum_p exp2(m_p - M) * l_p,   M = max_p m_p.
With one partition the first kernel writes the final output and no reduce runs.

Only sequences with exactly one query token are served; in a mixed batch the others are left
to the prefill kernel (programs for them exit at once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.attention import AttentionMetadata
from sluice.kernels.launch import num_multiprocessors
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
def _paged_decode_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [T, Hq, D], written when not SPLIT
    part_out_ptr,  # [B, Hq, P, D] float32, written when SPLIT
    part_max_ptr,  # [B, Hq, P] float32
    part_sum_ptr,  # [B, Hq, P] float32
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
    stride_pb,
    stride_ph,
    stride_pp,
    stride_mb,
    stride_mh,
    qk_scale,
    head_dim,
    group_size,
    partition_size,
    PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - token
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    if (q_len != 1) | (start >= seq_len):
        return
    end = tl.minimum(start + partition_size, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < group_size
    mask_d = offs_d < head_dim
    mask_gd = mask_g[:, None] & mask_d[None, :]
    heads = kv_head * group_size + offs_g  # [BLOCK_G] query heads of this KV head
    q = tl.load(
        q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_gd,
        other=0.0,
    )
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q, offs_g,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head,
        start, end,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        qk_scale, head_dim,
        PAGE_SIZE, BLOCK_N, BLOCK_D, False, DOT_PRECISION, UPCAST_DOT,
    )  # fmt: skip
    out = acc / l_i[:, None]
    if SPLIT:
        row = seq.to(tl.int64) * stride_mb + heads * stride_mh + part
        tl.store(part_max_ptr + row, m_i, mask=mask_g)
        tl.store(part_sum_ptr + row, l_i, mask=mask_g)
        part_ptrs = (
            part_out_ptr
            + seq.to(tl.int64) * stride_pb
            + heads[:, None] * stride_ph
            + part * stride_pp
            + offs_d[None, :]
        )
        tl.store(part_ptrs, out, mask=mask_gd)
    else:
        out_ptrs = out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_gd)


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr,  # [B, Hq, P, D] float32
    part_max_ptr,  # [B, Hq, P] float32
    part_sum_ptr,  # [B, Hq, P] float32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [T, Hq, D]
    stride_pb,
    stride_ph,
    stride_pp,
    stride_mb,
    stride_mh,
    stride_ot,
    stride_oh,
    head_dim,
    partition_size,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - token
    if q_len != 1:
        return
    num_parts = tl.cdiv(tl.load(seq_lens_ptr + seq), partition_size)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    stats_ptr = seq.to(tl.int64) * stride_mb + head * stride_mh  # offset of this row's [P] stats
    o_base = part_out_ptr + seq.to(tl.int64) * stride_pb + head * stride_ph
    # Two passes over the partitions in chunks of BLOCK_P, so a long context with many
    # partitions never needs a [P, D] tile in registers: the global max, then the weighted sum.
    m_max = float("-inf")
    for p0 in range(0, num_parts, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        m_p = tl.load(part_max_ptr + stats_ptr + offs_p, mask=offs_p < num_parts, other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m_p, 0))
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    denom = 0.0
    for p0 in range(0, num_parts, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask_p = offs_p < num_parts
        m_p = tl.load(part_max_ptr + stats_ptr + offs_p, mask=mask_p, other=float("-inf"))
        l_p = tl.load(part_sum_ptr + stats_ptr + offs_p, mask=mask_p, other=0.0)
        weight = tl.exp2(m_p - m_max) * l_p  # [BLOCK_P]; 0 past the last partition
        o_ptrs = o_base + offs_p[:, None] * stride_pp + offs_d[None, :]
        o_p = tl.load(o_ptrs, mask=mask_p[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_P, BLOCK_D]
        acc += tl.sum(o_p * weight[:, None], 0)
        denom += tl.sum(weight, 0)
    out = acc / denom
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def _default_partition_size(q: torch.Tensor, num_programs: int, max_seq_len: int, block_n: int) -> int:
    """Split the context until the grid has about two programs per multiprocessor.

    Partitions are powers of two of at least 256 tokens (and at least one tile), so a partition
    amortises its partial-result write and the reduce stays small; on CPU nothing is split.
    Under CUDA graphs max_seq_len is the captured maximum, so short contexts split less.
    """
    if not q.is_cuda:
        return triton.cdiv(max_seq_len, block_n) * block_n
    target = 2 * num_multiprocessors(
        q.device.index if q.device.index is not None else torch.cuda.current_device()
    )
    splits = max(1, target // max(num_programs, 1))
    return max(256, block_n, triton.next_power_of_2(triton.cdiv(max_seq_len, splits)))


def paged_decode_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]; rows of non-decode sequences are left as they are
    partition_size: int | None = None,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """Attention of every single-token sequence in the batch over its paged context.

    partition_size: context tokens per split-KV partition (a multiple of tiles.block_n); by
    default chosen so the grid has about two programs per multiprocessor (never split on CPU).
    tiles: launch shape (block_m is unused: the rows of a tile are the GQA group's heads).
    """
    check_paged_inputs("paged_decode", q, k_cache, v_cache, meta)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    out = paged_output("paged_decode", q, out)
    num_seqs = meta.num_seqs
    if num_seqs == 0:
        return out
    tiles = tiles or default_tiles(q)
    block_n = tiles.block_n
    if partition_size is None:
        partition_size = _default_partition_size(q, num_seqs * num_kv_heads, meta.max_seq_len, block_n)
    if partition_size <= 0 or partition_size % block_n != 0:
        raise ValueError(f"paged_decode: partition_size must be a positive multiple of {block_n}")
    num_parts = triton.cdiv(meta.max_seq_len, partition_size)
    split = num_parts > 1
    block_d = head_block(head_dim)
    if split:
        part_out = torch.empty(
            num_seqs, num_q_heads, num_parts, head_dim, dtype=torch.float32, device=q.device
        )
        part_max = torch.empty(num_seqs, num_q_heads, num_parts, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:  # unused by the kernel; any float32 tensor satisfies the signature
        part_out = part_max = part_sum = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        out, part_out, part_max, part_sum,
        *paged_strides(q, k_cache, v_cache, meta, out),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_max.stride(0), part_max.stride(1),
        scale * LOG2E, head_dim, group_size, partition_size,
        PAGE_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT=split,
        **dot_flags(q),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    if split:
        _paged_decode_reduce_kernel[(num_seqs, num_q_heads)](
            part_out, part_max, part_sum, meta.query_start_loc, meta.seq_lens, out,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_max.stride(0), part_max.stride(1),
            out.stride(0), out.stride(1),
            head_dim, partition_size,
            BLOCK_P=min(32, triton.next_power_of_2(num_parts)),
            BLOCK_D=block_d,
            num_warps=4,
        )  # fmt: skip
    return out
