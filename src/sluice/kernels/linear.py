"""Dense projections y = x W^T (+ b): oneDNN's matmul for float32 on the CPU, `F.linear` elsewhere.

The CPU engine's step is mostly these GEMMs. `F.linear` runs MKL's sgemm, which on an AMD host
takes its AVX2 path even where the cores have AVX-512; oneDNN (the library vLLM's CPU build
calls too) picks its kernels from the CPU's features, and on the model's shapes ([T, 576] by
576..3072 columns, T from 1 to 2048) it ran ~1.3x faster here. It is the same float32 arithmetic
in another summation order: results move by float32 rounding (~1e-6 relative), as a different
batch shape already moves them under MKL, which the exactness tests' near-tie rule covers.
On CUDA, in other dtypes, or in a torch built without oneDNN, this is `F.linear`. The model calls
it through `Ops.linear`, which hands 1-4 rows (a decode step of a few sequences) to the native
skinny kernel (kernels/cpu_gemv.py) where it is built: there the weights' read from DRAM is the
whole cost, and that kernel streams them faster.

Pre-packed weights (`pack_weight`): given a plain [N, K] weight, oneDNN reorders it into its
blocked layout on every call; at decode sizes (1-64 rows) that reorder is a large part of the
call (the whole weight is read and written once more). `pack_weight` does the reorder once, at
load, and `linear(..., packed=...)` hands oneDNN the blocked copy: on the real model's shapes,
1 thread, interleaved, the per-step GEMM time fell 1.9x at 4 rows, 1.4x at 16, 1.16x at 64 and
~1.05x at 1 and 128. The packed and the plain call compute the same sums (bitwise equal from 4
rows up; at 1 row the plain call takes a gemv path that differs by float32 rounding).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The row count oneDNN is told to expect when it picks the packed layout; any row count runs on
# it. Decode batches are the hot case; 64 gave the best layout for 4-128 rows in the benchmark.
_PACK_BATCH_HINT = 64


@functools.cache
def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.ndim == 2
            and _onednn_available())


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a CPU float32 [N, K] weight, or None where `linear` would not use
    oneDNN (CUDA, other dtypes, no oneDNN, or a torch that cannot pack)."""
    if not (weight.is_cpu and weight.dtype == torch.float32 and weight.ndim == 2 and _onednn_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch without the op: plain weights still work
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K], weight: [N, K], bias: [N] or None -> [T, N]. `packed`: `pack_weight(weight)`."""
    # A packed weight exists only where oneDNN applies (pack_weight), so the hot path (121 calls a
    # decode step on the real model) skips the checks.
    if packed is not None or _onednn_applies(x, weight):
        if not x.is_contiguous():
            x = x.contiguous()  # the packed call wants dense rows (a strided view is refused)
        return torch.ops.mkldnn._linear_pointwise(x, weight if packed is None else packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
