"""Fused residual add + RMSNorm: Triton kernel, launcher and torch reference.

One program normalises one token row: it adds the residual, stores the new residual, and
writes weight * (x / rms(x)) without a second pass over memory. Statistics are in float32.
`rms_norm_torch` is the CPU hot path: torch's fused `rms_norm` (one call instead of five), used
only in float32, where it gives exactly the reference's bits (tests/kernels/test_pointwise.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sluice.kernels.launch import check_device


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H], read only when HAS_RESIDUAL
    weight_ptr,  # [H]
    out_ptr,  # [T, H]
    new_residual_ptr,  # [T, H], written only when HAS_RESIDUAL
    stride_xt,
    stride_rt,
    stride_ot,
    stride_nt,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden_size
    x = tl.load(x_ptr + row * stride_xt + offs_h, mask=mask_h, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype, as `x + residual` is in the reference.
        residual = tl.load(residual_ptr + row * stride_rt + offs_h, mask=mask_h, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_nt + offs_h, x, mask=mask_h)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden_size
    # normed is rounded to the activation dtype before the weight multiply, like HF's Llama.
    normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + offs_h, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask_h)


def rms_norm_triton(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm_ref`: returns (normed, new_residual)."""
    if x.ndim != 2:
        raise ValueError(f"rms_norm expects x of shape [tokens, hidden], got {tuple(x.shape)}")
    num_tokens, hidden_size = x.shape
    if weight.shape != (hidden_size,):
        raise ValueError(f"rms_norm weight must have shape ({hidden_size},), got {tuple(weight.shape)}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"rms_norm residual must match x ({tuple(x.shape)}, {x.dtype}), "
                f"got ({tuple(residual.shape)}, {residual.dtype})"
            )
        if residual.stride(-1) != 1:
            raise ValueError("rms_norm residual must be contiguous in its last dimension")
    if x.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError("rms_norm x and weight must be contiguous in their last dimension")
    check_device("rms_norm", x, weight, *([] if residual is None else [residual]))
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else x
    if num_tokens == 0:
        return out, new_residual
    block_h = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        new_residual,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        new_residual.stride(0),
        hidden_size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h,
        num_warps=min(max(block_h // 256, 1), 16),
    )
    return out, new_residual


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual) where new_residual = x + residual (or x when None).

    Computed in float32 and cast back, as HF's LlamaRMSNorm does.
    """
    if residual is not None:
        x = x + residual
    new_residual = x
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = xf * torch.rsqrt(variance + eps)
    return weight * normed.to(x.dtype), new_residual


def rms_norm_torch(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and, in float32, the same bits as `rms_norm_ref`, in one fused torch call."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return rms_norm_ref(x, weight, eps, residual)  # HF's cast-to-float32-and-back order
    if residual is not None:
        x = x + residual
    return F.rms_norm(x, (x.shape[-1],), weight, eps), x
