"""One entry point per operator; the backend ("torch" or "triton") is chosen once per engine.

"torch" runs the plain torch implementations (the CPU engine's path; attention uses the
batched `paged_attention_torch`); on float32 CPU tensors its small ops (RMSNorm, rotary + K/V
store, SiLU * up) go to the native kernels of `cpu_glue.py` once they are built, which
`begin_step` decides once per forward pass. "triton" runs the Triton kernels: on CUDA tensors
normally, on CPU tensors only under TRITON_INTERPRET=1 (set before triton is first imported),
which the tests use.
"""

from __future__ import annotations

from typing import Literal

import torch

from sluice.kernels import cpu_gemv, cpu_glue
from sluice.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from sluice.kernels.attention import AttentionMetadata, paged_attention_torch
from sluice.kernels.linear import linear
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
        # This step's native CPU paths (begin_step): small ops through cpu_glue, skinny projections
        # through cpu_gemv.
        self._native_glue = False
        self._skinny = False

    def begin_step(self, hidden: torch.Tensor, kv_dtype: torch.dtype) -> None:
        """Decides, once per forward pass, which native CPU kernels it runs: its RMSNorm, rotary +
        K/V store and SiLU * up through cpu_glue, and its projections of 1-4 rows (and the head's,
        in the same step) through cpu_gemv. Both need the torch backend, float32 CPU activations
        and the kernel built; cpu_glue also a float32 K/V cache. Every layer of the step then
        takes the same path."""
        cpu_float32 = not self._triton and hidden.is_cpu and hidden.dtype == torch.float32
        self._native_glue = cpu_float32 and kv_dtype == torch.float32 and cpu_glue.KERNEL.ready()
        self._skinny = cpu_float32 and cpu_gemv.ready()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, K] @ weight [N, K]^T (+ bias) -> [T, N]; `packed`: `linear.pack_weight(weight)`."""
        if self._skinny and cpu_gemv.takes(x):
            return cpu_gemv.skinny_linear(x, weight, bias)
        return linear(x, weight, bias, packed)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._triton:
            return rms_norm_triton(x, weight, eps, residual)
        if self._native_glue:
            return cpu_glue.add_rms_norm(x, weight, eps, residual)
        return rms_norm_torch(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self._triton:
            return silu_and_mul_triton(x)
        if self._native_glue:
            return cpu_glue.silu_and_mul(x)
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
        if self._native_glue and rope is not None:
            return cpu_glue.rotary_store_kv(q, k, v, rope, k_cache, v_cache, slot_mapping)
        return rotary_store_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, rope)

    def qkv_rotary_store_kv(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 * Hkv) * D]: a fused projection's [q | k | v] columns
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`rotary_store_kv` on the columns of a fused qkv projection; returns the rotated q
        [T, Hq, D]. The native CPU kernel takes qkv whole (one call, no split/view ops)."""
        if self._native_glue and rope is not None:
            return cpu_glue.qkv_rotary_store(qkv, num_heads, num_kv_heads, head_dim, rope, k_cache, v_cache,
                                             slot_mapping)
        num_tokens, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q, _ = self.rotary_store_kv(
            q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim), positions, cos_sin_cache, k_cache, v_cache,
            slot_mapping, rope)
        return q

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
