"""Pieces shared by the paged decode and prefill kernels: the online-softmax inner loop over
paged K/V, and launcher-side input validation and output allocation.

The inner loop walks a token range of one sequence's context in tiles of BLOCK_N tokens; each
token's cache row is found through the block table (page = pos // PAGE_SIZE), so a tile may
span several pages and BLOCK_N need not equal the page size. Scores use exp2 with the softmax
scale pre-multiplied by log2(e); the running max m and running sum l are therefore in log2
units, which the split-KV reduce relies on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sluice.kernels.attention import AttentionMetadata
from sluice.kernels.launch import check_device

LOG2E = math.log2(math.e)
MAX_HEAD_DIM = 256


@triton.jit
def attend_kv_range(
    acc,  # [M, BLOCK_D] float32: running sum of p @ v
    m_i,  # [M] float32: running max of the scores (log2 units)
    l_i,  # [M] float32: running sum of exp2(score - m_i)
    q,  # [M, BLOCK_D] in the cache dtype; padded rows and columns are zero
    q_pos,  # [M] int32: absolute position of each query row (used when CAUSAL)
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    v_cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    kv_head,
    start,  # first context token to visit
    end,  # one past the last context token to visit
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    qk_scale,  # softmax scale * log2(e)
    head_dim,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    mask_d = offs_d < head_dim
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        block_ids = tl.load(block_table_ptr + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        offs_in_page = offs_n % PAGE_SIZE
        # k: [BLOCK_D, BLOCK_N] (transposed for the dot), v: [BLOCK_N, BLOCK_D]
        k_ptrs = (
            k_cache_ptr
            + block_ids[None, :] * stride_kb
            + offs_in_page[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None]
        )
        k = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, BLOCK_N]
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf; use 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = (
            v_cache_ptr
            + block_ids[:, None] * stride_vb
            + offs_in_page[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :]
        )
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if UPCAST_DOT:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def dot_flags(q: torch.Tensor) -> dict[str, object]:
    """Constexpr flags for `attend_kv_range`'s dots, given the query tensor.

    float32 inputs get full-precision dots (tf32 would cost ~3e-4 relative error). On CPU the
    kernels run in Triton's interpreter, whose dot mishandles 16-bit float operands (seen with
    Triton 3.9: bf16 operands multiplied as raw bits), so there the operands are upcast first.
    """
    upcast = not q.is_cuda
    precision = "ieee" if upcast or q.dtype == torch.float32 else "tf32"
    return {"DOT_PRECISION": precision, "UPCAST_DOT": upcast}


def check_paged_inputs(
    op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Raises ValueError unless q, the caches and the metadata agree on shapes, dtypes, devices."""
    if q.ndim != 3:
        raise ValueError(f"{op}: q must be [tokens, q_heads, head_dim], got {tuple(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{op}: k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"{op}: cache head_dim {k_cache.shape[3]} differs from q head_dim {head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim {head_dim} exceeds the supported maximum {MAX_HEAD_DIM}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{op}: {num_q_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"{op}: q, k_cache, v_cache dtypes differ ({q.dtype}, {k_cache.dtype}, {v_cache.dtype})"
        )
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"{op}: q and the caches must be contiguous in head_dim")
    num_seqs = meta.num_seqs
    if len(meta.query_start_loc_host) != num_seqs + 1 or meta.query_start_loc_host[-1] != num_tokens:
        raise ValueError(
            f"{op}: query_start_loc must have {num_seqs + 1} entries ending at the {num_tokens} query tokens"
        )
    if meta.block_tables.ndim != 2 or meta.block_tables.shape[0] < num_seqs:
        raise ValueError(
            f"{op}: block_tables must be [num_seqs, max_blocks], got {tuple(meta.block_tables.shape)}"
        )
    block_size = k_cache.shape[1]
    if meta.max_seq_len > meta.block_tables.shape[1] * block_size:
        raise ValueError(
            f"{op}: max_seq_len {meta.max_seq_len} does not fit {meta.block_tables.shape[1]} blocks "
            f"of {block_size} tokens"
        )
    for name, t in (
        ("query_start_loc", meta.query_start_loc),
        ("seq_lens", meta.seq_lens),
        ("block_tables", meta.block_tables),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{op}: meta.{name} must be int32, got {t.dtype}")
    check_device(op, q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    if meta.block_tables.stride(1) != 1:
        raise ValueError(f"{op}: block_tables rows must be contiguous")


def paged_strides(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor
) -> tuple[int, ...]:
    """The strides both paged kernels take after their pointers, in their order: stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, stride_ot, stride_oh."""
    return (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1),
    )  # fmt: skip


def paged_output(op: str, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The tensor a launcher writes: `out` once checked against q, or a new one like q."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"{op}: out must be a {tuple(q.shape)} {q.dtype} tensor contiguous in head_dim")
    return out


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Launch shape of the paged attention kernels. block_m: query rows per program (prefill;
    decode packs the GQA group instead); block_n: KV tokens per inner-loop step."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"TileConfig.num_stages must be between 1 and 6, got {self.num_stages}")


# Under the CPU interpreter every lane costs time, so tiles stay at the 16-wide minimum.
INTERPRETER_TILES = TileConfig(block_m=16, block_n=16)


def default_tiles(q: torch.Tensor) -> TileConfig:
    return TileConfig() if q.is_cuda else INTERPRETER_TILES


def head_block(head_dim: int) -> int:
    """Power-of-two tile width covering head_dim (80 -> 128); the pad columns are masked."""
    return max(16, triton.next_power_of_2(head_dim))
