"""One entry point per operator; the backend ("torch" or "triton") is chosen once per engine.

"torch" runs the plain torch implementations (the CPU engine's path; attention uses the
batched `paged_attention_torch`). "triton" runs the Triton kernels: on CUDA tensors normally,
on CPU tensors only under TRITON_INTERPRET=1 (set before triton is first imported), which the
tests use.
"""

from __future__ import annotations

from typing import Literal

import torch

from sluice.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from sluice.kernels.attention import AttentionMetadata, paged_attention_torch
from sluice.kernels.paged_decode import paged_decode_triton
from sluice.kernels.paged_prefill import paged_prefill_triton
from sluice.kernels.rmsnorm import rms_norm_torch, rms_norm_triton
from sluice.kernels.rotary import rope_rows, rotary_store_kv_ref, rotary_store_kv_triton

Backend = Literal["torch", "triton"]


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Decode-only batches run the split-KV decode kernel; batches with prompt chunks run the
    varlen prefill kernel for the chunks and, if any decodes ride along, the decode kernel
    for those (each kernel skips the other's sequences)."""
    if meta.is_decode_only:
        return paged_decode_triton(q, k_cache, v_cache, meta, scale)
    starts = meta.query_start_loc_host
    has_decodes = any(starts[b + 1] - starts[b] == 1 for b in range(meta.num_seqs))
    out = paged_prefill_triton(q, k_cache, v_cache, meta, scale, skip_decodes=has_decodes)
    if has_decodes:
        paged_decode_triton(q, k_cache, v_cache, meta, scale, out=out)
    return out


class Ops:
    """The operator set the model calls; built once with a backend and passed down."""

    def __init__(self, backend: Backend) -> None:
        if backend not in ("torch", "triton"):
            raise ValueError(f"unknown kernel backend {backend!r}; expected 'torch' or 'triton'")
        self.backend: Backend = backend
        self._triton = backend == "triton"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._triton:
            return rms_norm_triton(x, weight, eps, residual)
        return rms_norm_torch(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self._triton:
            return silu_and_mul_triton(x)
        return silu_and_mul_ref(x)

    def rotary_store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._triton:  # the kernel reads the cos/sin rows of each position itself
            return rotary_store_kv_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
        return rotary_store_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, rope)

    def rope_rows(self, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's cos/sin rows for `rotary_store_kv`, gathered once instead of once per layer;
        None for the Triton kernel, which gathers them itself."""
        return None if self._triton else rope_rows(positions, cos_sin_cache)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self._triton:
            return paged_attention_triton(q, k_cache, v_cache, meta, scale)
        return paged_attention_torch(q, k_cache, v_cache, meta, scale)
