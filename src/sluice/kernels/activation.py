"""SiLU-and-multiply for gated MLPs: Triton kernel, launcher and torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sluice.kernels.launch import check_device


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * I] holding [gate | up]
    out_ptr,  # [T, I]
    stride_xt,
    stride_ot,
    intermediate_size,
    BLOCK_I: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < intermediate_size
    gate = tl.load(x_ptr + row * stride_xt + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + intermediate_size + offs_i, mask=mask_i, other=0.0)
    # silu(gate) is rounded to the activation dtype before the multiply, as F.silu(gate) * up is.
    act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    tl.store(
        out_ptr + row * stride_ot + offs_i,
        (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask_i,
    )


def silu_and_mul_triton(x: torch.Tensor, block_i: int = 1024) -> torch.Tensor:
    """x: [T, 2 * I] holding [gate | up] -> silu(gate) * up: [T, I]."""
    if x.ndim != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"silu_and_mul expects x of shape [tokens, 2 * intermediate], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul x must be contiguous in its last dimension")
    check_device("silu_and_mul", x)
    num_tokens, intermediate_size = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, intermediate_size, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate_size == 0:
        return out
    block_i = min(block_i, triton.next_power_of_2(intermediate_size))
    grid = (num_tokens, triton.cdiv(intermediate_size, block_i))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), intermediate_size, BLOCK_I=block_i, num_warps=4
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] holding [gate | up] -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
