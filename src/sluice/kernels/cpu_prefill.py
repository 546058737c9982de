"""Causal paged prefill attention on the CPU: a C++ kernel that skips the masked upper triangle.

The torch path (`attention.paged_attention_torch`) gathers each chunk's K/V into a padded tensor
and runs one `scaled_dot_product_attention` with an additive mask; torch's CPU SDPA computes the
whole [rows, context] score matrix, masked half included (also with is_causal=True), so a
512-token prompt pays for 512 x 512 scores where 512 x 256 are visible: 30 layers x 4.6 ms of the
real model's ~519 ms TTFT (2 threads).

This kernel tiles the work as a small GEMM: a task is (chunk, KV head, tile of query tokens),
whose rows are the tile's tokens x the query heads of the KV head's group (so each K/V load feeds
all heads of the group), walked against key tiles of KT keys from position 0 up to the tile's
last position only. Key tiles wholly visible to the whole query tile take no mask; the one or two
on the diagonal mask per row. The softmax is online (running max and sum per row, exact: the
accumulator is rescaled when the max grows). Phase 1 transposes each (chunk, KV head)'s cached
keys once into [tile][D][KT] scratch (a scattered block table becomes one contiguous run per key
tile); phase 2 runs the tasks, cost-balanced over ATen's threads (longest first), reading V rows
where they lie in the cache. The micro-kernels are written once over a vector type: AVX-512
(6 rows x 4 vectors of accumulators, 64-key tiles) where the CPU has it and head_dim % 16 == 0,
AVX2/FMA (3 x 4, 32-key tiles) where head_dim % 8 == 0, plain floats otherwise (any CPU, any
head_dim). A chunk after cached context (chunked prefill) and mixed batches of several
sequences' chunks are the same thing: each piece's rows sit at positions context_len - rows ..
context_len - 1. Float32; the same arithmetic as the reference in another summation order.

The C++ is kernels/csrc/cpu_prefill.cpp, built and loaded like `cpu_decode.py` (kernels/cpu_build.py,
kernels/native.py): `KERNEL.ready()` never compiles; SLUICE_CPU_PREFILL_KERNEL=0 (or not built): the torch path runs.
"""

from __future__ import annotations

import torch

from sluice.kernels.cpu_build import CSRC, NativeKernel

KERNEL = NativeKernel("sluice_cpu_paged_prefill", CSRC / "cpu_prefill.cpp", __name__,
                      switch="SLUICE_CPU_PREFILL_KERNEL", entry_points=("paged_prefill_cpu",))


def paged_prefill_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      pieces: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Writes into `out` [T, Hq, D] the attention of the query rows named by `pieces` [P, 4] int64
    (sequence row of `block_tables`, first token row, rows, context length including them) over
    their sequences' cached K/V; q: [T, Hq, D] float32. Call only if `KERNEL.ready()`."""
    assert KERNEL.module is not None
    KERNEL.module.paged_prefill(q.contiguous(), k_cache, v_cache, block_tables, pieces, scale, out)
