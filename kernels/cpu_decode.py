"""Gather-free paged decode attention on the CPU: a small C++ kernel that reads K/V blocks in place.

The torch path (`attention.paged_attention_torch`) has to copy every decoding sequence's K/V
blocks into a padded contiguous tensor, per layer and per step, before one fused SDPA call reads
them again: at 64 decoding sequences that copy was ~11% of a step and the attention call ~14%.
This kernel walks each sequence's block table and reads the cached rows where they lie: one
pass over K for the scores, a softmax in float32, one pass over V. Work is split over
(sequence, KV head) pairs with ATen's thread pool; the query heads that share a KV head are
done together, so each K/V row is read once per group.

It is built by `build()` with torch's C++ extension loader (a C++ compiler and ninja, which the
CPU image has) into `build_directory()`, and loaded from there by every later process. An engine
never compiles it on its own: `ready()` is True only once it is built (`sluice bench engine` and
`tests/kernels/test_cpu_decode.py` build it). Not built, not buildable, or
SLUICE_CPU_DECODE_KERNEL=0: the torch path runs; the kernel is a speed-up, never a requirement.
CUDA decodes use the Triton kernel instead (the model code is the same; only `Ops` differs).
Float32 only; the same arithmetic as the reference in another summation order (rounding-level).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// exp for x <= 0 (scores minus their max), Cephes' expf polynomial: within ~2 ulp of expf, and a
// loop of it vectorises (libm's expf does not), which matters: a decode step takes B*Hq*L of them.
static inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One (sequence, KV head): its G query heads against the sequence's cached rows, block by block.
template <int D>
static void attend_one(const float* qb, const float* kp, const float* vp, const int32_t* table,
                       int64_t L, int64_t BS, int64_t row, int64_t h, int64_t G, float sc,
                       std::vector<float>& scores, float* ob) {
  scores.resize(G * L);
  for (int64_t start = 0, j = 0; start < L; start += BS, ++j) {
    const int64_t n = std::min(BS, L - start);
    const float* kb = kp + static_cast<int64_t>(table[j]) * BS * row + h * D;
    for (int64_t o = 0; o < n; ++o) {
      const float* kr = kb + o * row;
      for (int64_t g = 0; g < G; ++g) {
        const float* qr = qb + g * D;
        float s = 0.f;
        #pragma omp simd reduction(+:s)
        for (int d = 0; d < D; ++d) s += qr[d] * kr[d];
        scores[g * L + start + o] = s * sc;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * L;
    float mx = s[0];
    for (int64_t t = 1; t < L; ++t) mx = std::max(mx, s[t]);
    #pragma omp simd
    for (int64_t t = 0; t < L; ++t) s[t] = exp_nonpositive(s[t] - mx);
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t t = 0; t < L; ++t) sum += s[t];
    const float inv = 1.f / sum;
    float acc[D];
    for (int d = 0; d < D; ++d) acc[d] = 0.f;
    for (int64_t start = 0, j = 0; start < L; start += BS, ++j) {
      const int64_t n = std::min(BS, L - start);
      const float* vb = vp + static_cast<int64_t>(table[j]) * BS * row + h * D;
      for (int64_t o = 0; o < n; ++o) {
        const float pr = s[start + o];
        const float* vr = vb + o * row;
        #pragma omp simd
        for (int d = 0; d < D; ++d) acc[d] += pr * vr[d];
      }
    }
    float* out = ob + g * D;
    for (int d = 0; d < D; ++d) out[d] = acc[d] * inv;
  }
}

static void attend_dyn(const float* qb, const float* kp, const float* vp, const int32_t* table,
                       int64_t L, int64_t BS, int64_t row, int64_t h, int64_t G, int64_t D, float sc,
                       std::vector<float>& scores, float* ob) {
  scores.resize(G * L);
  for (int64_t t = 0; t < L; ++t) {
    const float* kr = kp + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row + h * D;
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qb[g * D + d] * kr[d];
      scores[g * L + t] = s * sc;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * L;
    float mx = s[0];
    for (int64_t t = 1; t < L; ++t) mx = std::max(mx, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) { s[t] = exp_nonpositive(s[t] - mx); sum += s[t]; }
    float* out = ob + g * D;
    for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      const float* vr = vp + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row + h * D;
      for (int64_t d = 0; d < D; ++d) out[d] += s[t] * vr[d];
    }
    for (int64_t d = 0; d < D; ++d) out[d] /= sum;
  }
}

// q [B, Hq, D], caches [NB, BS, Hkv, D], block_tables [B, M] int32, seq_lens [B] int32 -> out [B, Hq, D]
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32, "int32 tables");
  auto tables = block_tables.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv, M = tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row = Hkv * D;  // floats between consecutive slots of one block
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hkv, h = idx % Hkv;
      const float* qb = qp + (b * Hq + h * G) * D;
      float* ob = op + (b * Hq + h * G) * D;
      const int32_t* table = tp + b * M;
      if (D == 64) attend_one<64>(qb, kp, vp, table, lp[b], BS, row, h, G, sc, scores, ob);
      else if (D == 128) attend_one<128>(qb, kp, vp, table, lp[b], BS, row, h, G, sc, scores, ob);
      else attend_dyn(qb, kp, vp, table, lp[b], BS, row, h, G, D, sc, scores, ob);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
"""


_NAME = "sluice_cpu_paged_decode_v2"


def build_directory() -> Path:
    """Where the kernel is built and looked for: SLUICE_KERNEL_CACHE or ~/.cache/sluice/kernels."""
    root = os.environ.get("SLUICE_KERNEL_CACHE") or Path.home() / ".cache" / "sluice" / "kernels"
    return Path(root) / _NAME


def _disabled() -> bool:
    return os.environ.get("SLUICE_CPU_DECODE_KERNEL", "1") == "0"


_loaded: Any | None = None
_tried = False


def build() -> bool:
    """Builds the kernel (if it is not built yet: a C++ compile of a minute or more) and loads it;
    False, with a warning, if it cannot be built. The engine bench calls this before timing."""
    global _loaded, _tried
    if _loaded is not None:
        return True
    if _disabled():
        return False
    try:
        from torch.utils.cpp_extension import load_inline

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        _loaded = load_inline(name=_NAME, cpp_sources=[_SOURCE], build_directory=str(directory),
                              extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: the torch path still works
        log.warning("CPU decode kernel unavailable, using the torch path: %s", str(exc).splitlines()[0])
        _loaded = None
    _tried = True
    return _loaded is not None


def ready() -> bool:
    """Whether the kernel can run now without compiling: loaded, or built before (by `build()` in
    any process on this machine), then loaded. Never compiles, so an engine's first step does not
    wait a minute for a compiler; `sluice bench engine` builds it first."""
    global _loaded, _tried
    if _loaded is not None:
        return True
    if _tried or _disabled():
        return False
    path = build_directory() / f"{_NAME}.so"
    if not path.is_file():
        return False  # looked for again at the next call: a bench or the test may build it meanwhile
    # The built module is imported as it is, never through the extension loader: that loader may
    # decide to rebuild (a minute of compiling inside an engine step) and waits on its build lock,
    # forever if a killed build left one behind.
    _tried = True
    try:
        spec = importlib.util.spec_from_file_location(_NAME, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded = module
    except Exception as exc:  # half-written by a build in progress, or built for another torch
        log.warning("CPU decode kernel at %s could not be loaded, using the torch path: %s", path, exc)
        _loaded = None
    return _loaded is not None


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, Hq, D] float32, one decode token per sequence -> [B, Hq, D]. Call only if `ready()`."""
    assert _loaded is not None
    return _loaded.paged_decode(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale)
