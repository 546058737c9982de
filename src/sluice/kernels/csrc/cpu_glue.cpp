// sluice_cpu_glue: a decoder layer's small ops on the CPU, one call each: residual add + RMSNorm,
// rotary + K/V store, SiLU(gate) * up. Loaded by sluice/kernels/cpu_glue.py, whose docstring gives
// what each op matches bit for bit; built by kernels/cpu_build.py.

// torch's tensor API and its pybind11 casters, not <torch/extension.h>: that one adds the whole C++
// frontend (nn, optim, data) and takes ~1.7x as long to compile.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
// No fused multiply-add contraction in any code of ours (HF's rotary rounds each product); after
// torch's headers, so their inline functions keep the build's own flags.
#pragma GCC optimize("fp-contract=off")
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// SLEEF's 1-ulp expf, exported by libtorch_cpu: what torch's Vectorized<float>::exp() calls.
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif
#if defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

// Rows per task: a task gets ~128K floats of work, so a decode step's few rows run inline on the
// calling thread (waking a pool thread, ~20-50 us under OMP_WAIT_POLICY=PASSIVE, costs more than
// such an op) and only a prefill's hundreds of rows are split.
static inline int64_t grain(int64_t work_per_row) {
  return std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, work_per_row));
}

// ---- residual add + RMSNorm -------------------------------------------------------------
// x [T, H] (rows strided, last dim contiguous), residual [T, H] or None, weight [H]
// -> (weight * (s * rsqrt(mean(s^2) + eps)), s) with s = x + residual (s = x when None).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat32, "x: [T, H] float32");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.stride(0) == 1 &&
              weight.scalar_type() == torch::kFloat32, "weight: [H] float32");
  const bool has_res = residual.has_value();
  if (has_res) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                residual->scalar_type() == torch::kFloat32, "residual: like x");
  }
  auto out = torch::empty({T, H}, x.options());
  torch::Tensor sum = has_res ? torch::empty({T, H}, x.options()) : x;
  const float* xp = x.data_ptr<float>();
  const float* rp = has_res ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = has_res ? sum.data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0), rs = has_res ? residual->stride(0) : 0;
  const float feps = static_cast<float>(eps), fh = static_cast<float>(H);
  at::parallel_for(0, T, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict src = xp + t * xs;
      if (has_res) {
        const float* __restrict r = rp + t * rs;
        float* __restrict s = sp + t * H;
        #pragma omp simd
        for (int64_t i = 0; i < H; ++i) s[i] = src[i] + r[i];
        src = s;
      }
      float ss = 0.0f;
      #pragma omp simd reduction(+:ss)
      for (int64_t i = 0; i < H; ++i) {
        const float sq = src[i] * src[i];
        ss += sq;
      }
      const float inv = 1.0f / std::sqrt(ss / fh + feps);
      float* __restrict o = op + t * H;
      #pragma omp simd
      for (int64_t i = 0; i < H; ++i) {
        const float n = src[i] * inv;
        o[i] = n * wp[i];
      }
    }
  });
  return {out, sum};
}

// ---- rotary + K/V cache store -------------------------------------------------------------
struct Heads {  // one [T, H, D] operand: base, token stride, head stride (last dim contiguous)
  const float* p;
  int64_t st, sh, n;
};

static inline void rotate(const float* __restrict x, const float* __restrict c, const float* __restrict s,
                          float* __restrict o, int64_t half) {
  #pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * c[i];
    const float b = x[i + half] * s[i];
    o[i] = a - b;
  }
  #pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i + half] * c[i];
    const float b = x[i] * s[i];
    o[i + half] = a + b;
  }
}

// Rotates q into q_out [T, Hq, D] and k into the cache slots (and k_out [T, Hkv, D] when given),
// copies v into the v cache; a negative slot (a padding token) caches nothing.
static void rotary_store(Heads q, Heads k, Heads v, int64_t D, const torch::Tensor& cos,
                         const torch::Tensor& sin, torch::Tensor& k_cache, torch::Tensor& v_cache,
                         const torch::Tensor& slots, float* q_out, float* k_out, int64_t T) {
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
              cos.size(0) == T && sin.size(0) == T && cos.size(-1) == D / 2 && sin.size(-1) == D / 2 &&
              cos.stride(-1) == 1 && sin.stride(-1) == 1, "cos/sin: [T, 1, D/2] float32 rows");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32 &&
              k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(2) == k.n && k_cache.size(3) == D &&
              v_cache.sizes() == k_cache.sizes() && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
              k_cache.stride(0) == k_cache.size(1) * k_cache.stride(1) &&
              v_cache.stride(0) == v_cache.size(1) * v_cache.stride(1), "caches: [NB, BS, Hkv, D] float32");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.size(0) == T, "slots: [T] int64");
  auto sl = slots.contiguous();
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slp[t] < num_slots, "slot out of range");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t cst = cos.stride(0), sst = sin.stride(0), half = D / 2;
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t kcs = k_cache.stride(1), kch = k_cache.stride(2), vcs = v_cache.stride(1), vch = v_cache.stride(2);
  at::parallel_for(0, T, grain((q.n + 2 * k.n) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * cst;
      const float* s = sp + t * sst;
      for (int64_t h = 0; h < q.n; ++h) rotate(q.p + t * q.st + h * q.sh, c, s, q_out + (t * q.n + h) * D, half);
      const int64_t slot = slp[t];
      for (int64_t h = 0; h < k.n; ++h) {
        const float* kx = k.p + t * k.st + h * k.sh;
        if (k_out != nullptr) {
          float* ko = k_out + (t * k.n + h) * D;
          rotate(kx, c, s, ko, half);
          if (slot >= 0) std::memcpy(kc + slot * kcs + h * kch, ko, D * sizeof(float));
        } else if (slot >= 0) {
          rotate(kx, c, s, kc + slot * kcs + h * kch, half);
        }
        if (slot >= 0) std::memcpy(vc + slot * vcs + h * vch, v.p + t * v.st + h * v.sh, D * sizeof(float));
      }
    }
  });
}

static Heads heads_of(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.scalar_type() == torch::kFloat32,
              name, ": [T, H, D] float32, last dim contiguous");
  return Heads{x.data_ptr<float>(), x.stride(0), x.stride(1), x.size(1)};
}

// q [T, Hq, D], k and v [T, Hkv, D] -> (q rotated, k rotated), both contiguous.
std::vector<torch::Tensor> rotary_store_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                                           torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                           torch::Tensor slots) {
  const Heads hq = heads_of(q, "q"), hk = heads_of(k, "k"), hv = heads_of(v, "v");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && k.size(0) == T && k.size(2) == D && v.sizes() == k.sizes(), "q/k/v shapes");
  auto q_out = torch::empty({T, hq.n, D}, q.options());
  auto k_out = torch::empty({T, hk.n, D}, k.options());
  rotary_store(hq, hk, hv, D, cos, sin, k_cache, v_cache, slots, q_out.data_ptr<float>(), k_out.data_ptr<float>(), T);
  return {q_out, k_out};
}

// qkv [T, (Hq + 2 Hkv) D] (a fused projection's output; rows may be strided) -> q rotated [T, Hq, D];
// rotated k goes only to the cache.
torch::Tensor qkv_rotary_store(torch::Tensor qkv, int64_t Hq, int64_t Hkv, int64_t D, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.scalar_type() == torch::kFloat32 &&
              qkv.size(1) == (Hq + 2 * Hkv) * D && D % 2 == 0, "qkv: [T, (Hq + 2 Hkv) D] float32");
  const int64_t T = qkv.size(0), st = qkv.stride(0);
  const float* p = qkv.data_ptr<float>();
  auto q_out = torch::empty({T, Hq, D}, qkv.options());
  rotary_store(Heads{p, st, D, Hq}, Heads{p + Hq * D, st, D, Hkv}, Heads{p + (Hq + Hkv) * D, st, D, Hkv}, D,
               cos, sin, k_cache, v_cache, slots, q_out.data_ptr<float>(), nullptr, T);
  return q_out;
}

// ---- SiLU(gate) * up ----------------------------------------------------------------------
static inline float silu_scalar(float x) { return x / (1.0f + std::exp(-x)); }  // torch's scalar op

// x [T, 2I] holding [gate | up] -> silu(gate) * up [T, I]. `lanes`: torch's Vectorized<float>
// width at its dispatch level (16 AVX512, 8 AVX2, 0 none); torch's loop runs two vectors per
// step and leaves the rest of each row to the scalar op, and so does this one (all of each row
// where built without AVX2 or AVX512: `lanes` is then unused).
torch::Tensor silu_and_mul(torch::Tensor x, [[maybe_unused]] int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0 && x.scalar_type() == torch::kFloat32,
              "x: [T, 2I] float32");
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      if (lanes == 16) {
        const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
        for (; i + 16 <= (I / 32) * 32; i += 16) {
          const __m512 gv = _mm512_loadu_ps(g + i);
          const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(gv, sign));
          _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
        }
      }
#endif
#if defined(__AVX2__)
      if (lanes == 8) {
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= (I / 16) * 16; i += 8) {
          const __m256 gv = _mm256_loadu_ps(g + i);
          const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(gv, sign));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
      }
#endif
      for (; i < I; ++i) o[i] = silu_scalar(g[i]) * u[i];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rotary_store_kv", &rotary_store_kv);
  m.def("qkv_rotary_store", &qkv_rotary_store);
  m.def("silu_and_mul", &silu_and_mul);
}
