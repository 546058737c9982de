"""Rotary position embedding fused with the write of K/V into the paged cache.

Rotation is the GPT-NeoX "rotate half" form used by Llama, Mistral and Qwen2.
cos_sin_cache: [max_position, head_dim] holding cos in the first half and sin in the second,
each of width head_dim // 2 (already scaled for llama3 / linear rope scaling by the model).

The Triton kernel handles one token per program: it reads that token's cos/sin once, rotates
all its query and key heads, and stores the rotated key and the value straight into the
token's cache slot, so rotated K never makes an extra round trip through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.launch import check_device


@triton.jit
def _rotate_heads(
    src_ptr,  # one token's [H, D] slice, head stride stride_h, last dim contiguous
    dst_ptr,  # same shape
    stride_src_h,
    stride_dst_h,
    cos,  # [1, BLOCK_HALF] float32
    sin,
    num_heads,
    half_dim,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_HEADS)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < num_heads) & (offs_d < half_dim)
    src = src_ptr + offs_h * stride_src_h + offs_d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half_dim, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + offs_h * stride_dst_h + offs_d
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half_dim, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    positions_ptr,  # [T] int64
    cos_sin_ptr,  # [max_position, D]
    q_out_ptr,  # [T, Hq, D]
    k_out_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos_p,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_kc_slot,  # k_cache stride per slot (block_size * Hkv * D when contiguous)
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    num_q_heads,
    num_kv_heads,
    half_dim,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask_d = offs_d < half_dim
    cos = tl.load(cos_sin_ptr + pos * stride_cos_p + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cos_p + half_dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    _rotate_heads(
        q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_qh, stride_qoh,
        cos, sin, num_q_heads, half_dim, BLOCK_Q_HEADS, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_kh, stride_koh,
        cos, sin, num_kv_heads, half_dim, BLOCK_KV_HEADS, BLOCK_HALF,
    )  # fmt: skip

    # A negative slot marks a padding token (e.g. a CUDA-graph pad row): nothing is cached.
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        # Rotated K is re-read from k_out (just written by this program) and cast to the cache
        # dtype, matching the reference's k_rot.to(k_cache.dtype).
        offs_h = tl.arange(0, BLOCK_KV_HEADS)[:, None]
        offs_full = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        mask_kv = (offs_h < num_kv_heads) & (offs_full < 2 * half_dim)
        k_rot = tl.load(k_out_ptr + token * stride_kot + offs_h * stride_koh + offs_full, mask=mask_kv)
        tl.store(
            k_cache_ptr + slot * stride_kc_slot + offs_h * stride_kc_h + offs_full,
            k_rot.to(k_cache_ptr.dtype.element_ty),
            mask=mask_kv,
        )
        v = tl.load(v_ptr + token * stride_vt + offs_h * stride_vh + offs_full, mask=mask_kv)
        tl.store(
            v_cache_ptr + slot * stride_vc_slot + offs_h * stride_vc_h + offs_full,
            v.to(v_cache_ptr.dtype.element_ty),
            mask=mask_kv,
        )


def _check_heads(name: str, t: torch.Tensor, num_tokens: int, head_dim: int) -> None:
    if t.ndim != 3 or t.shape[0] != num_tokens or t.shape[2] != head_dim:
        raise ValueError(
            f"rotary_store_kv: {name} must be [{num_tokens}, heads, {head_dim}], got {tuple(t.shape)}"
        )
    if t.stride(2) != 1:
        raise ValueError(f"rotary_store_kv: {name} must be contiguous in its last dimension")


def rotary_store_kv_triton(
    q: torch.Tensor,  # [T, Hq, D]; views of a fused qkv projection are fine (strided tokens)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_position, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rotary_store_kv_ref`: caches rotated k and v, returns (q, k) rotated."""
    if q.ndim != 3:
        raise ValueError(f"rotary_store_kv: q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2 != 0:
        raise ValueError(f"rotary_store_kv: head_dim must be even, got {head_dim}")
    _check_heads("q", q, num_tokens, head_dim)
    _check_heads("k", k, num_tokens, head_dim)
    _check_heads("v", v, num_tokens, head_dim)
    num_kv_heads = k.shape[1]
    if v.shape != k.shape:
        raise ValueError(f"rotary_store_kv: v {tuple(v.shape)} must match k {tuple(k.shape)}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"rotary_store_kv: positions {tuple(positions.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must both be [{num_tokens}]"
        )
    if positions.dtype.is_floating_point or slot_mapping.dtype.is_floating_point:
        raise ValueError("rotary_store_kv: positions and slot_mapping must be integer tensors")
    if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"rotary_store_kv: cos_sin_cache must be a contiguous-row [max_position, {head_dim}] tensor, "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.ndim != 4 or cache.shape[2:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"rotary_store_kv: {name} must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
                f"got {tuple(cache.shape)}"
            )
        if cache.stride(3) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1):
            raise ValueError(f"rotary_store_kv: {name} must have contiguous blocks and rows")
    check_device("rotary_store_kv", q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    block_half = triton.next_power_of_2(head_dim // 2)
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, q_out, k_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        num_q_heads, num_kv_heads, head_dim // 2,
        BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half,
        num_warps=4,
    )  # fmt: skip
    return q_out, k_out


def _joint_qk(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, Hq + Hkv, D] view when k's heads follow q's in memory (the column
    split of a fused qkv projection), else None."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if (q.dtype != k.dtype or q.stride() != k.stride() or q.stride(1) != head_dim
            or k.data_ptr() != q.data_ptr() + num_q_heads * head_dim * q.element_size()):
        return None
    return q.as_strided((q.shape[0], num_q_heads + k.shape[1], head_dim), q.stride())


def rope_rows(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) rows of `positions`, each [T, 1, D/2] float32: the same for every layer of a step."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).float().chunk(2, dim=-1)
    return cos, sin


def rotary_store_kv_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_position, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # rope_rows(positions, cos_sin_cache)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k, writes rotated k and v into their cache slots, returns (q, k) rotated.

    q and k are rotated as one [T, Hq + Hkv, D] tensor (the CPU engine's hot path: half the calls):
    a view when they are adjacent columns of the fused qkv projection, a copy otherwise. Each half
    of the result is written in place (`out=`), in HF's order: x1 * cos - x2 * sin and
    x2 * cos + x1 * sin, each product rounded on its own (no fused multiply-add), so float32
    results are HF's bits. `rope`: the step's cos/sin rows, gathered once for all layers (the
    model's forward does it); None: gathered here.
    """
    cos, sin = rope_rows(positions, cos_sin_cache) if rope is None else rope  # [T, 1, D/2]
    num_q_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], k.shape[2]
    joint = _joint_qk(q, k) if q.dtype == torch.float32 else None
    x = torch.cat((q, k), dim=1).float() if joint is None else joint  # [T, Hq + Hkv, D]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    r1, r2 = rotated.chunk(2, dim=-1)
    torch.mul(x1, cos, out=r1).sub_(x2 * sin)
    torch.mul(x2, cos, out=r2).add_(x1 * sin)
    q_rot, k_rot = rotated[:, :num_q_heads].to(q.dtype), rotated[:, num_q_heads:].to(k.dtype)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k_rot.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q_rot, k_rot
