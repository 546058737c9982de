// sluice_cpu_paged_prefill: causal paged prefill attention on the CPU that skips the masked upper
// triangle (query tiles against key tiles up to the diagonal, online softmax). Loaded by
// sluice/kernels/cpu_prefill.py, whose docstring gives the design, the measurements and the
// arithmetic; built by kernels/cpu_build.py.

// torch's tensor API and its pybind11 casters, not <torch/extension.h>: that one adds the whole C++
// frontend (nn, optim, data) and takes ~1.7x as long to compile.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_AVX2 1
#endif
#if defined(SLUICE_AVX2) && defined(__AVX512F__)
#define SLUICE_AVX512 1
#endif

static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp for x <= 0 (scores minus their running max), Cephes' expf polynomial (within ~2 ulp of
// expf), once for every backend S: below -87 it is 0, so a masked score (-inf) gives exactly 0.
// S supplies floor, fnma (c - a * b), pow2 (2^n of an integral n) and zero_below (0 where x < -87).
template <class S>
static inline typename S::V exp_poly(typename S::V x) {
  using V = typename S::V;
  const V clamped = S::max(x, S::set1(-87.0f));
  const V n = S::floor(S::fma(clamped, S::set1(1.44269504088896341f), S::set1(0.5f)));
  V r = S::fnma(n, S::set1(0.693359375f), clamped);
  r = S::fma(n, S::set1(2.12194440e-4f), r);
  V p = S::set1(1.9875691500e-4f);
  p = S::fma(p, r, S::set1(1.3981999507e-3f));
  p = S::fma(p, r, S::set1(8.3334519073e-3f));
  p = S::fma(p, r, S::set1(4.1665795894e-2f));
  p = S::fma(p, r, S::set1(1.6666665459e-1f));
  p = S::fma(p, r, S::set1(5.0000001201e-1f));
  p = S::fma(S::mul(p, r), r, S::add(r, S::set1(1.0f)));
  return S::zero_below(x, S::mul(p, S::pow2(n)));
}

// A vector backend: W lanes; ROWS x NV accumulators in the score micro-kernel (KT = NV * W keys
// per key tile) and ROWS x NVD in the value one.
struct Plain {
  using V = float;
  static constexpr int W = 1, ROWS = 3, NV = 4, NVD = 4;
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V set1(float x) { return x; }
  static V zero() { return 0.f; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V max(V a, V b) { return std::max(a, b); }
  static V sub(V a, V b) { return a - b; }
  static V add(V a, V b) { return a + b; }
  static V mul(V a, V b) { return a * b; }
  static float hmax(V v) { return v; }
  static float hsum(V v) { return v; }
  static V floor(V x) { return std::floor(x); }
  static V fnma(V a, V b, V c) { return c - a * b; }
  static V pow2(V n) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  }
  static V zero_below(V x, V v) { return x < -87.0f ? 0.f : v; }
  static V exp(V x) { return exp_poly<Plain>(x); }
};

#ifdef SLUICE_AVX2
struct Avx2 {
  using V = __m256;
  static constexpr int W = 8, ROWS = 3, NV = 4, NVD = 4;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static float hmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static V floor(V x) { return _mm256_floor_ps(x); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V pow2(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static V zero_below(V x, V v) { return _mm256_andnot_ps(_mm256_cmp_ps(x, set1(-87.0f), _CMP_LT_OQ), v); }
  static V exp(V x) { return exp_poly<Avx2>(x); }
};
#endif

#ifdef SLUICE_AVX512
// GCC 12 warns "'__Y' may be used uninitialized" inside its own avx512fintrin.h wherever an
// intrinsic that passes _mm512_undefined_ps() (a self-initialised don't-care operand) is inlined
// into other code (GCC bug 105593): a false alarm, silenced where these wrappers inline them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
struct Avx512 {
  using V = __m512;
  static constexpr int W = 16, ROWS = 6, NV = 4, NVD = 4;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static V floor(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static V zero_below(V x, V v) {
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x, set1(-87.0f), _CMP_LT_OQ)), v);
  }
  static V exp(V x) { return exp_poly<Avx512>(x); }
};
#pragma GCC diagnostic pop
#endif

// Query rows of one piece: tokens token_start .. token_start + rows, the last at position
// context_len - 1; its keys are the sequence's cached rows 0 .. context_len - 1.
struct Piece {
  int64_t seq, token_start, rows, context_len;
};

struct Problem {
  const float* q;  // [T, Hq, D]
  float* out;      // [T, Hq, D]
  const float* k;  // [NB, BS, Hkv, D]
  const float* v;
  const int32_t* tables;  // [B, M]
  int64_t M, Hq, Hkv, G, D, BS;
  float scale;
  const float* slot(const float* cache, int64_t seq, int64_t key, int64_t h) const {
    const int64_t block = tables[seq * M + key / BS];
    return cache + ((block * BS + key % BS) * Hkv + h) * D;
  }
};

// s[i][0:KT] = q_i . k_t for ROWS query rows (q: stride D) against one key tile (kt: [D][KT]).
template <class B>
static inline void score_block(const float* q, int64_t D, const float* kt, float* s) {
  constexpr int KT = B::W * B::NV;
  typename B::V a[B::ROWS][B::NV];
  for (int i = 0; i < B::ROWS; ++i)
    for (int v = 0; v < B::NV; ++v) a[i][v] = B::zero();
  for (int64_t d = 0; d < D; ++d) {
    typename B::V kv[B::NV];
    for (int v = 0; v < B::NV; ++v) kv[v] = B::load(kt + d * KT + v * B::W);
    for (int i = 0; i < B::ROWS; ++i) {
      const typename B::V qi = B::set1(q[i * D + d]);
      for (int v = 0; v < B::NV; ++v) a[i][v] = B::fma(qi, kv[v], a[i][v]);
    }
  }
  for (int i = 0; i < B::ROWS; ++i)
    for (int v = 0; v < B::NV; ++v) B::store(s + i * KT + v * B::W, a[i][v]);
}

// acc[i][d0 : d0 + N*W] += sum_t p[i][t] * v_t[d0 : ...] for ROWS rows over n keys (vrows[t]:
// the cached V row of key t): ROWS x N accumulators in registers, each V load feeds ROWS FMAs.
template <class B, int N>
static inline void value_block(const float* p, int64_t kt_stride, const float* const* vrows, int64_t n,
                               int64_t d0, float* acc, int64_t D) {
  typename B::V a[B::ROWS][N];
  for (int i = 0; i < B::ROWS; ++i)
    for (int v = 0; v < N; ++v) a[i][v] = B::load(acc + i * D + d0 + v * B::W);
  for (int64_t t = 0; t < n; ++t) {
    typename B::V vv[N];
    for (int v = 0; v < N; ++v) vv[v] = B::load(vrows[t] + d0 + v * B::W);
    for (int i = 0; i < B::ROWS; ++i) {
      const typename B::V pi = B::set1(p[i * kt_stride + t]);
      for (int v = 0; v < N; ++v) a[i][v] = B::fma(pi, vv[v], a[i][v]);
    }
  }
  for (int i = 0; i < B::ROWS; ++i)
    for (int v = 0; v < N; ++v) B::store(acc + i * D + d0 + v * B::W, a[i][v]);
}

template <class B>
static inline void value_rows(const float* p, const float* const* vrows, int64_t n, float* acc, int64_t D) {
  constexpr int KT = B::W * B::NV;
  const int64_t vecs = D / B::W;
  int64_t c = 0;
  for (; c + B::NVD <= vecs; c += B::NVD) value_block<B, B::NVD>(p, KT, vrows, n, c * B::W, acc, D);
  switch (vecs - c) {
    case 3: value_block<B, 3>(p, KT, vrows, n, c * B::W, acc, D); break;
    case 2: value_block<B, 2>(p, KT, vrows, n, c * B::W, acc, D); break;
    case 1: value_block<B, 1>(p, KT, vrows, n, c * B::W, acc, D); break;
    default: break;
  }
}

// Phase 1: the piece's keys of KV head h, transposed into key tiles kt[tile][D][KT], zero past
// the context (those scores are masked; the zeros keep them finite).
template <class B>
static void transpose_keys(const Problem& pr, const Piece& pc, int64_t h, float* kt) {
  constexpr int KT = B::W * B::NV;
  const int64_t D = pr.D, tiles = (pc.context_len + KT - 1) / KT;
  for (int64_t j = 0; j < tiles; ++j) {
    float* tile = kt + j * D * KT;
    for (int64_t t = 0; t < KT; ++t) {
      const int64_t key = j * KT + t;
      if (key >= pc.context_len) {
        for (int64_t d = 0; d < D; ++d) tile[d * KT + t] = 0.f;
        continue;
      }
      const float* src = pr.slot(pr.k, pc.seq, key, h);
      for (int64_t d = 0; d < D; ++d) tile[d * KT + t] = src[d];
    }
  }
}

struct Scratch {
  std::vector<float> q, s, acc, m, l;
  std::vector<int64_t> pos;
  std::vector<const float*> vrows;
};

// Phase 2, one task: query tokens i0 .. i1 of the piece (rows: token x query head of KV head h's
// group) against key tiles 0 .. the tile's last position, online softmax, out = acc / sum.
template <class B>
static void attend_tile(const Problem& pr, const Piece& pc, int64_t h, int64_t i0, int64_t i1, const float* kt,
                        Scratch& sc) {
  constexpr int KT = B::W * B::NV, ROWS = B::ROWS;
  const int64_t G = pr.G, D = pr.D;
  const int64_t rows = (i1 - i0) * G, padded = (rows + ROWS - 1) / ROWS * ROWS;
  const int64_t first_pos = pc.context_len - pc.rows;  // position of the piece's token 0
  const int64_t min_pos = first_pos + i0, max_pos = first_pos + i1 - 1;
  sc.q.assign(padded * D, 0.f);
  sc.s.resize(padded * KT);
  sc.acc.assign(padded * D, 0.f);
  sc.m.assign(padded, kNegInf);
  sc.l.assign(padded, 0.f);
  sc.pos.assign(padded, max_pos);  // padded rows (q = 0) see every key: finite, discarded
  sc.vrows.resize(KT);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = i0 + r / G;
    const float* src = pr.q + ((pc.token_start + tok) * pr.Hq + h * G + r % G) * D;
    float* dst = sc.q.data() + r * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * pr.scale;
    sc.pos[r] = first_pos + tok;
  }
  float* s = sc.s.data();
  float* acc = sc.acc.data();
  for (int64_t k0 = 0; k0 <= max_pos; k0 += KT) {
    const int64_t n = std::min<int64_t>(KT, max_pos + 1 - k0);
    const float* tile = kt + (k0 / KT) * D * KT;
    for (int64_t r0 = 0; r0 < padded; r0 += ROWS) score_block<B>(sc.q.data() + r0 * D, D, tile, s + r0 * KT);
    const bool diagonal = k0 + KT - 1 > min_pos;
    for (int64_t r = 0; r < padded; ++r) {
      float* sr = s + r * KT;
      if (diagonal)
        for (int64_t t = std::max<int64_t>(0, std::min<int64_t>(KT, sc.pos[r] - k0 + 1)); t < KT; ++t)
          sr[t] = kNegInf;
      typename B::V mv = B::load(sr);
      for (int v = 1; v < B::NV; ++v) mv = B::max(mv, B::load(sr + v * B::W));
      const float old = sc.m[r];
      const float mx = std::max(old, B::hmax(mv));  // finite: key 0 is visible to every row
      typename B::V sum = B::zero();
      const typename B::V mxv = B::set1(mx);
      for (int v = 0; v < B::NV; ++v) {
        const typename B::V p = B::exp(B::sub(B::load(sr + v * B::W), mxv));
        B::store(sr + v * B::W, p);
        sum = B::add(sum, p);
      }
      if (old != mx) {
        const float corr = old == kNegInf ? 0.f : Plain::exp(old - mx);
        sc.l[r] *= corr;
        float* ar = acc + r * D;
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
        sc.m[r] = mx;
      }
      sc.l[r] += B::hsum(sum);
    }
    for (int64_t t = 0; t < n; ++t) sc.vrows[t] = pr.slot(pr.v, pc.seq, k0 + t, h);
    for (int64_t r0 = 0; r0 < padded; r0 += ROWS) value_rows<B>(s + r0 * KT, sc.vrows.data(), n, acc + r0 * D, D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = i0 + r / G;
    float* dst = pr.out + ((pc.token_start + tok) * pr.Hq + h * G + r % G) * D;
    const float inv = 1.f / sc.l[r];
    const float* ar = acc + r * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = ar[d] * inv;
  }
}

struct Task {
  int64_t piece, head, i0, i1;
  double cost;
};

template <class B>
static void run(const Problem& pr, const std::vector<Piece>& pieces) {
  constexpr int KT = B::W * B::NV;
  const int64_t P = static_cast<int64_t>(pieces.size()), Hkv = pr.Hkv, D = pr.D;
  // Phase 1: transposed keys of every (piece, KV head).
  std::vector<int64_t> offset(P + 1, 0);
  for (int64_t p = 0; p < P; ++p) offset[p + 1] = offset[p] + (pieces[p].context_len + KT - 1) / KT * KT * D * Hkv;
  std::vector<float> keys(offset[P]);
  at::parallel_for(0, P * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Piece& pc = pieces[i / Hkv];
      const int64_t per_head = (pc.context_len + KT - 1) / KT * KT * D;
      transpose_keys<B>(pr, pc, i % Hkv, keys.data() + offset[i / Hkv] + (i % Hkv) * per_head);
    }
  });
  // Phase 2: tasks of ~48 rows (tokens x group heads), longest first onto the least loaded thread.
  const int64_t tile_tokens = std::max<int64_t>(1, 48 / pr.G);
  std::vector<Task> tasks;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i0 = 0; i0 < pieces[p].rows; i0 += tile_tokens) {
      const int64_t i1 = std::min(pieces[p].rows, i0 + tile_tokens);
      const double keys_seen = static_cast<double>(pieces[p].context_len - pieces[p].rows + i1);
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({p, h, i0, i1, (i1 - i0) * (keys_seen + KT)});
    }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<std::vector<int64_t>> bins(threads);
  std::vector<double> load(threads, 0.0);
  for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
    const int64_t least = std::min_element(load.begin(), load.end()) - load.begin();
    bins[least].push_back(t);
    load[least] += tasks[t].cost;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t b = begin; b < end; ++b)
      for (int64_t t : bins[b]) {
        const Task& task = tasks[t];
        const Piece& pc = pieces[task.piece];
        const int64_t per_head = (pc.context_len + KT - 1) / KT * KT * D;
        attend_tile<B>(pr, pc, task.head, task.i0, task.i1,
                       keys.data() + offset[task.piece] + task.head * per_head, sc);
      }
  });
}

// q [T, Hq, D], caches [NB, BS, Hkv, D], block_tables [B, M] int32, pieces [P, 4] int64 (seq,
// token_start, rows, context_len); writes the pieces' rows of out [T, Hq, D] (others untouched).
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                   torch::Tensor pieces, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && pieces.dtype() == torch::kInt64, "int32 tables, int64 pieces");
  TORCH_CHECK(q.sizes() == out.sizes() && pieces.dim() == 2 && pieces.size(1) == 4, "shapes");
  auto tables = block_tables.contiguous();
  auto spec = pieces.contiguous();
  const int64_t Hq = q.size(1), D = q.size(2), BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes(), "shapes");
  const Problem pr{q.data_ptr<float>(), out.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                   tables.data_ptr<int32_t>(), tables.size(1), Hq, Hkv, Hq / Hkv, D, BS, static_cast<float>(scale)};
  std::vector<Piece> list;
  const int64_t* sp = spec.data_ptr<int64_t>();
  for (int64_t i = 0; i < spec.size(0); ++i) {
    const Piece pc{sp[4 * i], sp[4 * i + 1], sp[4 * i + 2], sp[4 * i + 3]};
    TORCH_CHECK(pc.rows >= 1 && pc.context_len >= pc.rows && pc.token_start >= 0 &&
                pc.token_start + pc.rows <= q.size(0) && pc.seq >= 0 && pc.seq < tables.size(0) &&
                (pc.context_len + BS - 1) / BS <= tables.size(1), "piece out of range");
    list.push_back(pc);
  }
  if (list.empty()) return;
#ifdef SLUICE_AVX512
  if (D % 16 == 0) return run<Avx512>(pr, list);
#endif
#ifdef SLUICE_AVX2
  if (D % 8 == 0) return run<Avx2>(pr, list);
#endif
  run<Plain>(pr, list);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_prefill", &paged_prefill); }
