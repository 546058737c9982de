// sluice_cpu_grammar_mask: grammar token masks applied to rows of a logits tensor in place, on the
// CPU. Loaded by sluice/kernels/cpu_grammar_mask.py, whose docstring gives the design; built by
// kernels/cpu_build.py.

// torch's tensor API and its pybind11 casters, not <torch/extension.h>: that one adds the whole C++
// frontend (nn, optim, data) and takes ~1.7x as long to compile.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
#include <algorithm>
#include <cstdint>
#include <limits>

// logits [N, V] float32, contiguous; rows [K] int64, each in [0, N); bitmask [K, ceil(V / 32)]
// int32, contiguous. Bit j of word w of bitmask row k allows token 32 w + j of logits row rows[k];
// every other token of that row becomes -inf, an allowed one keeps its logit (no write at all).
void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be a contiguous float32 [N, V] tensor");
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.dim() == 1 && rows.is_contiguous(), "rows must be int64 [K]");
  TORCH_CHECK(bitmask.dtype() == torch::kInt32 && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [K, W] tensor");
  TORCH_CHECK(logits.device().is_cpu() && rows.device().is_cpu() && bitmask.device().is_cpu(), "CPU tensors only");
  const int64_t n_rows = logits.size(0), vocab = logits.size(1), k_rows = rows.size(0);
  const int64_t n_words = (vocab + 31) / 32;
  TORCH_CHECK(bitmask.size(0) == k_rows && bitmask.size(1) == n_words, "bitmask shape does not fit the logits");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < k_rows; ++k) TORCH_CHECK(row_ids[k] >= 0 && row_ids[k] < n_rows, "row index out of range");
  float* out = logits.data_ptr<float>();
  const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float blocked = -std::numeric_limits<float>::infinity();
  // A grammar's row is lopsided (inside a JSON structure a handful of tokens are allowed, inside a
  // string nearly all): an all-ones word is skipped, an all-zeros word is 32 plain stores, and only
  // mixed words are read bit by bit. One pass over the row, no temporaries. One thread: the pass is
  // bound by memory (~2 ms for 64 rows of a 49k vocab), and on a shared host a split over two
  // OpenMP threads waited for the descheduled one (64 rows: 21.6 ms median on 2 threads, 2.3 ms on 1).
  for (int64_t k = 0; k < k_rows; ++k) {
    float* row = out + row_ids[k] * vocab;
    const uint32_t* mask = words + k * n_words;
    for (int64_t w = 0; w < n_words; ++w) {
      const uint32_t bits = mask[w];
      if (bits == 0xFFFFFFFFu) continue;
      float* x = row + 32 * w;
      const int64_t n = std::min<int64_t>(32, vocab - 32 * w);  // the last word may pass the vocab
      if (bits == 0) {
        for (int64_t j = 0; j < n; ++j) x[j] = blocked;
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {
        if (!((bits >> j) & 1u)) x[j] = blocked;
      }
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("apply_token_bitmask", &apply_token_bitmask); }
