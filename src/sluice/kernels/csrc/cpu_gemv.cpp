// sluice_cpu_gemv: skinny projections y = x W^T (+ b) on the CPU for 1-4 rows of x, streaming the
// weight once. Loaded by sluice/kernels/cpu_gemv.py, whose docstring gives the design, the
// measurements and the arithmetic; built by kernels/cpu_build.py.

// torch's tensor API and its pybind11 casters, not <torch/extension.h>: that one adds the whole C++
// frontend (nn, optim, data) and takes ~1.7x as long to compile.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
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
