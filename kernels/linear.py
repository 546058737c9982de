"""Dense projections y = x W^T (+ b): oneDNN's matmul for float32 on the CPU, `F.linear` elsewhere.

The CPU engine's step is mostly these GEMMs. `F.linear` runs MKL's sgemm, which on an AMD host
takes its AVX2 path even where the cores have AVX-512; oneDNN (the library vLLM's CPU build
calls too) picks its kernels from the CPU's features, and on the model's shapes ([T, 576] by
576..3072 columns, T from 1 to 2048) it ran ~1.3x faster here. It is the same float32 arithmetic
in another summation order: results move by float32 rounding (~1e-6 relative), as a different
batch shape already moves them under MKL, which the exactness tests' near-tie rule covers.
On CUDA, in other dtypes, or in a torch built without oneDNN, this is `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K], weight: [N, K], bias: [N] or None -> [T, N]."""
    if x.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.ndim == 2 \
            and _onednn_available():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
