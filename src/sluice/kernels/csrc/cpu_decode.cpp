// sluice_cpu_paged_decode: gather-free paged decode attention on the CPU. Each sequence's K/V
// blocks are read in place through its block table, for its one query row (a decode) or few (a
// verification chunk: a decode and its drafts). Loaded by sluice/kernels/cpu_decode.py, whose
// docstring gives the design, the measurements and the arithmetic; built by kernels/cpu_build.py.

// torch's tensor API and its pybind11 casters, not <torch/extension.h>: that one adds the whole C++
// frontend (nn, optim, data) and takes ~1.7x as long to compile.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_AVX2 1
#endif

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

// Where one sequence's work lives: its query rows, output rows and cached rows. A plain decode
// has one query row; a verification chunk (a decode and its speculative drafts) has R, the last
// R tokens of the sequence, and row r attends to the first L - (R - 1 - r) cached rows.
struct Job {
  const float* q;       // [R, Hq, D] this sequence's query rows
  float* out;           // [R, Hq, D]
  const float* k;       // cache base, [NB, BS, Hkv, D]
  const float* v;
  const int32_t* table; // [M] block ids
  int64_t L, R, BS, Hkv, G, D;
  float scale;
};

#ifdef SLUICE_AVX2
// Lane i of the result is the sum of a[i]'s eight lanes.
static inline __m256 hsum_8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// scores[t] = scale * q . k_t for the n rows of one block (k: the block's first row of this head,
// rows `row` floats apart); 8 rows at a time, so each q vector load feeds 8 FMAs.
static inline void block_scores(const float* q, const float* k, int64_t n, int64_t row, int64_t D,
                                float scale, float* scores) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    const float* kt = k + t * row;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt + r * row + d), acc[r]);
    }
    _mm256_storeu_ps(scores + t, _mm256_mul_ps(hsum_8x8(acc), sc));
  }
  for (; t < n; ++t) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + t * row + d), acc);
    scores[t] = hsum(acc) * scale;
  }
}

// acc[g][0:8W] += sum_t p[g][t] * v_t[0:8W] for GT query heads over the n rows of one block: the
// GT x W accumulators stay in registers, each V vector load feeds GT FMAs.
template <int GT, int W>
static inline void block_values(const float* const* p, const float* v, int64_t n, int64_t row, float* const* acc) {
  __m256 a[GT][W];
  for (int g = 0; g < GT; ++g)
    for (int w = 0; w < W; ++w) a[g][w] = _mm256_loadu_ps(acc[g] + 8 * w);
  for (int64_t t = 0; t < n; ++t) {
    __m256 vr[W];
    for (int w = 0; w < W; ++w) vr[w] = _mm256_loadu_ps(v + t * row + 8 * w);
    for (int g = 0; g < GT; ++g) {
      const __m256 pg = _mm256_broadcast_ss(p[g] + t);
      for (int w = 0; w < W; ++w) a[g][w] = _mm256_fmadd_ps(pg, vr[w], a[g][w]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc[g] + 8 * w, a[g][w]);
}

template <int GT>
static inline void block_values_d(const float* const* p, const float* v, int64_t n, int64_t row, int64_t D,
                                  float* const* acc) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    float* ad[GT];
    for (int g = 0; g < GT; ++g) ad[g] = acc[g] + d;
    block_values<GT, 4>(p, v + d, n, row, ad);
  }
  for (; d < D; d += 8) {
    float* ad[GT];
    for (int g = 0; g < GT; ++g) ad[g] = acc[g] + d;
    block_values<GT, 1>(p, v + d, n, row, ad);
  }
}
#endif

// Portable versions (no AVX2, or a head_dim that is not a multiple of 8).
static inline void block_scores_plain(const float* q, const float* k, int64_t n, int64_t row, int64_t D,
                                      float scale, float* scores) {
  for (int64_t t = 0; t < n; ++t) {
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int64_t d = 0; d < D; ++d) s += q[d] * k[t * row + d];
    scores[t] = s * scale;
  }
}

static inline void block_values_plain(const float* p, const float* v, int64_t n, int64_t row, int64_t D, float* acc) {
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t];
    #pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += pt * v[t * row + d];
  }
}

// Asks for a block's rows of heads h0..h1 ahead of their use: blocks are scattered over the pool,
// so the hardware prefetcher cannot see the next one coming. HINT: into L1 (the next block) or
// L2 (this block's V rows during pass 1: a sequence's V is a few hundred KiB at most, and having
// it requested early keeps twice as many misses in flight; 8-10% at 16-128 sequences).
// Without AVX2 it asks for nothing (the plain loops run there).
#ifdef SLUICE_AVX2
template <int HINT>
static inline void prefetch_block(const float* base, int64_t n, int64_t row, int64_t first, int64_t count) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t f = 0; f < count; f += 16)
      _mm_prefetch(reinterpret_cast<const char*>(base + t * row + first + f), static_cast<enum _mm_hint>(HINT));
}
#else
template <int HINT>
static inline void prefetch_block(const float*, int64_t, int64_t, int64_t, int64_t) {}
#endif

// KV heads h0..h1 of one sequence. Pass 1 walks its blocks once and scores every query vector of
// those heads (each query head of a head's group, in each query row) against each cached row while
// the block is in L1; then an exact softmax per query vector (max, exp, sum over its own causal
// length; the scores of a sequence are a few KiB); pass 2 walks the V blocks once the same way,
// a vector's rows past its causal length weighted by exact zeros. K and V are each read once, in
// place, for all the query rows: no gather, no padding. Each row's result is what a one-row call
// with its own length computes, bit for bit.
static void attend(const Job& j, int64_t h0, int64_t h1, std::vector<float>& scratch) {
  const int64_t G = j.G, D = j.D, L = j.L, BS = j.BS, R = j.R;
  const int64_t row = j.Hkv * D;       // floats between consecutive slots of one block
  const int64_t q_row = j.Hkv * G * D; // floats between consecutive query rows (Hq * D)
  const int64_t vecs = (h1 - h0) * G * R;
  // Query vector i = ((h - h0) * G + g) * R + r: head h, group member g, query row r.
  auto q_of = [&](int64_t i) {
    const int64_t r = i % R, hg = h0 * G + i / R;
    return j.q + r * q_row + hg * D;
  };
  auto out_of = [&](int64_t i) {
    const int64_t r = i % R, hg = h0 * G + i / R;
    return j.out + r * q_row + hg * D;
  };
  auto len_of = [&](int64_t i) { return std::max<int64_t>(L - (R - 1 - i % R), 0); };
  if (L <= 0) {  // nothing to attend to (not a decode the engine makes): zeros, not a NaN
    for (int64_t i = 0; i < vecs; ++i) std::fill(out_of(i), out_of(i) + D, 0.f);
    return;
  }
  scratch.resize(vecs * (L + D));
  float* scores = scratch.data();          // [vecs, L]
  float* acc = scratch.data() + vecs * L;  // [vecs, D]
  std::fill(acc, acc + vecs * D, 0.f);
#ifdef SLUICE_AVX2
  const bool vec = D % 8 == 0;
#else
  const bool vec = false;
#endif
  for (int64_t start = 0, b = 0; start < L; start += BS, ++b) {
    const int64_t n = std::min(BS, L - start);
    const float* kb = j.k + static_cast<int64_t>(j.table[b]) * BS * row;
    prefetch_block<_MM_HINT_T1>(j.v + static_cast<int64_t>(j.table[b]) * BS * row, n, row, h0 * D, (h1 - h0) * D);
    if (start + BS < L)
      prefetch_block<_MM_HINT_T0>(j.k + static_cast<int64_t>(j.table[b + 1]) * BS * row,
                                  std::min(BS, L - start - BS), row, h0 * D, (h1 - h0) * D);
    for (int64_t i = 0; i < vecs; ++i) {
      const int64_t m = std::min(n, len_of(i) - start);  // this vector's rows of the block
      if (m <= 0) continue;
      const float* kh = kb + (h0 + i / (G * R)) * D;
      float* s = scores + i * L + start;
#ifdef SLUICE_AVX2
      if (vec) { block_scores(q_of(i), kh, m, row, D, j.scale, s); continue; }
#endif
      block_scores_plain(q_of(i), kh, m, row, D, j.scale, s);
    }
  }
  std::vector<float> inv(vecs);
  for (int64_t i = 0; i < vecs; ++i) {
    float* s = scores + i * L;
    const int64_t Li = len_of(i);
    if (Li == 0) {
      std::fill(s, s + L, 0.f);
      inv[i] = 0.f;
      continue;
    }
    float mx = s[0];
    for (int64_t t = 1; t < Li; ++t) mx = std::max(mx, s[t]);
    #pragma omp simd
    for (int64_t t = 0; t < Li; ++t) s[t] = exp_nonpositive(s[t] - mx);
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t t = 0; t < Li; ++t) sum += s[t];
    std::fill(s + Li, s + L, 0.f);  // the rows after this query row's own token
    inv[i] = 1.f / sum;
  }
  for (int64_t start = 0, b = 0; start < L; start += BS, ++b) {
    const int64_t n = std::min(BS, L - start);
    const float* vb = j.v + static_cast<int64_t>(j.table[b]) * BS * row;
    if (start + BS < L)
      prefetch_block<_MM_HINT_T0>(j.v + static_cast<int64_t>(j.table[b + 1]) * BS * row,
                                  std::min(BS, L - start - BS), row, h0 * D, (h1 - h0) * D);
    for (int64_t h = h0; h < h1; ++h) {
      const float* vh = vb + h * D;
      const int64_t first = (h - h0) * G * R, count = G * R;  // this head's query vectors
      if (!vec) {
        for (int64_t i = first; i < first + count; ++i)
          block_values_plain(scores + i * L + start, vh, n, row, D, acc + i * D);
        continue;
      }
#ifdef SLUICE_AVX2
      // Three query vectors at a time: 3 x 4 vectors = 12 accumulators (of 16 registers).
      for (int64_t i = first; i < first + count; i += 3) {
        const int64_t gt = std::min<int64_t>(3, first + count - i);
        const float* p[3];
        float* a[3];
        for (int64_t k = 0; k < gt; ++k) {
          p[k] = scores + (i + k) * L + start;
          a[k] = acc + (i + k) * D;
        }
        if (gt == 3) block_values_d<3>(p, vh, n, row, D, a);
        else if (gt == 2) block_values_d<2>(p, vh, n, row, D, a);
        else block_values_d<1>(p, vh, n, row, D, a);
      }
#endif
    }
  }
  for (int64_t i = 0; i < vecs; ++i) {
    float* out = out_of(i);
    const float* a = acc + i * D;
    #pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = a[d] * inv[i];
  }
}

// q [T, Hq, D], caches [NB, BS, Hkv, D], block_tables [B, M] int32, seq_lens [B] int32 (context
// including the query rows), query_start_loc [B + 1] int32 (sequence b's query rows are
// q[qsl[b]:qsl[b + 1]]; empty: one row each, T == B) -> out [T, Hq, D]
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                           double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32 &&
              query_start_loc.dtype() == torch::kInt32, "int32 tables");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto starts = query_start_loc.contiguous();
  const int64_t B = tables.size(0), T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == D, "shapes");
  TORCH_CHECK(lens.size(0) == B, "one length per sequence");
  const bool one_row = starts.numel() == 0;
  TORCH_CHECK(one_row ? T == B : starts.size(0) == B + 1, "query rows");
  const int64_t G = Hq / Hkv, M = tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* sp = one_row ? nullptr : starts.data_ptr<int32_t>();
  if (sp != nullptr) TORCH_CHECK(sp[0] == 0 && sp[B] == T, "query_start_loc must span q");
  auto job = [&](int64_t b) {
    const int64_t first = one_row ? b : sp[b], rows = one_row ? 1 : sp[b + 1] - sp[b];
    return Job{qp + first * Hq * D, op + first * Hq * D, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
               tp + b * M, lp[b], rows, BS, Hkv, G, D, static_cast<float>(scale)};
  };
  // Whole sequences per task while there are enough of them (each block is then read as one
  // contiguous run of all its heads); (sequence, KV head) pairs when there are few, so two
  // threads still share one long sequence.
  // A batch with under ~256K floats of K/V in all (one short sequence) runs inline: waking a pool
  // thread costs more than the split saves.
  int64_t kv_floats = 0;
  for (int64_t b = 0; b < B; ++b) kv_floats += std::max<int32_t>(lp[b], 0) * Hkv * D * 2;
  const bool inline_all = kv_floats < (int64_t{1} << 18);
  if (B >= 4 * at::get_num_threads()) {
    at::parallel_for(0, B, inline_all ? B : 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t b = begin; b < end; ++b) attend(job(b), 0, Hkv, scratch);
    });
  } else {
    at::parallel_for(0, B * Hkv, inline_all ? B * Hkv : 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t i = begin; i < end; ++i) attend(job(i / Hkv), i % Hkv, i % Hkv + 1, scratch);
    });
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
