"""Skinny projections on the CPU: y = x W^T (+ b) for 1-4 rows of x, streaming the plain weight once.

A decode step of one to four sequences multiplies a few activation rows by every weight of the
model: ~540 MB of float32 on SmolLM2-135M, read from DRAM each step (no cache holds them), while
the arithmetic is a few hundred MFLOP. The step is bound by how fast the weights stream in.
oneDNN's packed GEMM reads them at ~15 GB/s at 1 row on this 2-core host (host read bandwidth:
~29 GB/s); this kernel reads each thread's share of weight rows front to back, one contiguous run
(the hardware prefetcher's best case), and multiplies every loaded weight vector by all the
activation rows at once, so the x rows stay in registers and L1. Over the 30 layers and the head,
interleaved against the packed oneDNN call, 2 threads: 1.55x at 1 row, 1.35x at 2, ~1.2x at 3-4;
from 6 rows up oneDNN's blocked kernel wins, so `Ops.linear` hands over only up to `MAX_ROWS`.

Arithmetic: each output is a dot product summed in 8 lanes by FMA along K, then the 8 lanes added
once; the same float32 products as oneDNN's in another summation order (rounding-level, ~1e-6
relative; the exactness tests' near-tie rule covers what that may move, as for oneDNN vs MKL).
AVX2 + FMA and K a multiple of 8 only (`ready`, `takes`); elsewhere oneDNN or F.linear keep the call.

The C++ is kernels/csrc/cpu_gemv.cpp, built and loaded like kernels/cpu_decode.py (kernels/native.py
lists it); SLUICE_CPU_GEMV_KERNEL=0 turns it off. Batch composition: a lone stream (1-4 rows,
this kernel) and a busy batch (oneDNN) sum in different orders, so a greedy near-tie could
resolve differently by what a stream is batched with. Measured on SmolLM2-135M-Instruct
(`bench/batch_invariance.py`, 16 chat prompts x 256 greedy tokens, each alone and all 16 together,
no prefix cache, the kernel off and on): all four runs gave the same 16 texts token for token.
"""

from __future__ import annotations

import torch

from sluice.kernels.cpu_build import CSRC, NativeKernel

# Up to this many rows the kernel beats oneDNN's packed GEMM on the model's shapes (see above).
MAX_ROWS = 4

KERNEL = NativeKernel("sluice_cpu_gemv", CSRC / "cpu_gemv.cpp", __name__, switch="SLUICE_CPU_GEMV_KERNEL",
                      entry_points=("skinny_linear",))

_vectorised: bool | None = None  # the loaded build's answer, asked once


def ready() -> bool:
    """Whether the kernel is loaded with its AVX2 path (`Ops.begin_step` asks once a step)."""
    global _vectorised
    if not KERNEL.ready():
        return False
    if _vectorised is None:
        assert KERNEL.module is not None
        _vectorised = bool(KERNEL.module.vectorised())
    return _vectorised


def takes(x: torch.Tensor) -> bool:
    """Whether `skinny_linear` takes this [T, K] input of a step that `ready` cleared (float32 CPU
    activations): 1-`MAX_ROWS` rows and K a multiple of 8. Cheap enough for every projection."""
    return x.ndim == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] % 8 == 0


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS), weight: [N, K] float32 CPU -> [M, N]. Call where `takes`."""
    assert KERNEL.module is not None
    y: torch.Tensor = KERNEL.module.skinny_linear(x, weight, bias)
    return y
