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

Built and loaded like kernels/cpu_decode.py (kernels/native.py lists it); SLUICE_CPU_GEMV_KERNEL=0
turns it off. Batch composition: a lone stream (1-4 rows, this kernel) and a busy batch (oneDNN)
sum in different orders, so a greedy near-tie could resolve differently by what a stream is
batched with. Measured on SmolLM2-135M-Instruct (`bench/batch_invariance.py`, 16 chat prompts
x 256 greedy tokens, each alone and all 16 together, no prefix cache, the kernel off and on): all four runs gave
the same 16 texts token for token.
"""

from __future__ import annotations

import torch

from sluice.kernels.cpu_build import NativeKernel

# Up to this many rows the kernel beats oneDNN's packed GEMM on the model's shapes (see above).
MAX_ROWS = 4

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_AVX2 1

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// y[m, r] = x[m, :] . w[r, :] (+ b[r]) for MT rows of x and RT consecutive rows of w (K % 8 == 0):
// MT x RT accumulators in registers; each weight vector is loaded once and feeds MT FMAs.
template <int MT, int RT>
static inline void tile(const float* x, int64_t K, const float* w, const float* b, float* y, int64_t ldy) {
  __m256 acc[MT][RT];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < RT; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[RT];
    for (int r = 0; r < RT; ++r) wv[r] = _mm256_loadu_ps(w + r * K + k);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < RT; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < RT; ++r) y[m * ldy + r] = hsum(acc[m][r]) + (b ? b[r] : 0.f);
}

// Weight rows n0..n1 (one contiguous run of the weight) against MT rows of x.
template <int MT, int RT>
static void run(const float* x, int64_t K, const float* w, const float* b, float* y, int64_t ldy,
                int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + RT <= n1; n += RT) tile<MT, RT>(x, K, w + n * K, b ? b + n : nullptr, y + n, ldy);
  for (; n < n1; ++n) tile<MT, 1>(x, K, w + n * K, b ? b + n : nullptr, y + n, ldy);
}
#endif

bool vectorised() {
#ifdef SLUICE_AVX2
  return true;
#else
  return false;
#endif
}

// x [M, K] (M <= 4), w [N, K], bias [N] or None -> y [M, N]; float32, contiguous, K % 8 == 0.
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 4 && K % 8 == 0, "1-4 rows and K a multiple of 8");
  TORCH_CHECK(vectorised(), "built without AVX2/FMA");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  torch::Tensor bc;
  if (bias.has_value()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.dtype() == torch::kFloat32 && bc.numel() == N, "bias");
  }
  auto y = torch::empty({M, N}, x.options());
#ifdef SLUICE_AVX2
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // ~128 KiB of weight per task: a small projection still splits over the threads, and a task is
  // long enough for the prefetcher to run ahead.
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 15) / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    // Accumulators per tile: MT x RT <= 12 of the 16 vector registers.
    switch (M) {
      case 1: run<1, 8>(xp, K, wp, bp, yp, N, n0, n1); break;
      case 2: run<2, 6>(xp, K, wp, bp, yp, N, n0, n1); break;
      case 3: run<3, 4>(xp, K, wp, bp, yp, N, n0, n1); break;
      default: run<4, 3>(xp, K, wp, bp, yp, N, n0, n1); break;
    }
  });
#endif
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear);
  m.def("vectorised", &vectorised);
}
"""

KERNEL = NativeKernel("sluice_cpu_gemv", _SOURCE, __name__, switch="SLUICE_CPU_GEMV_KERNEL",
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
