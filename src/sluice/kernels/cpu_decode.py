"""Gather-free paged decode attention on the CPU: a C++ kernel that reads K/V blocks in place.

The torch path (`attention.paged_attention_torch`) copies every decoding sequence's K/V blocks
into a padded contiguous tensor, per layer and per step, before one fused SDPA call reads them
again: at 64 decoding sequences that copy was ~11% of a step and the attention call ~14%. Decode
attention is memory-bound (each K/V element feeds one multiply-add per query head of its group:
3 for SmolLM2-135M), so what counts is reading each cached row once, in place.

This kernel walks each sequence's block table. A sequence brings one query row (a decode) or a
few (a verification chunk: a decode and its speculative drafts, each row attending up to its own
position); all its rows share one read of its K/V. Pass 1 scores every query head of a KV head's
group, in every query row, against each row of a block while the block sits in L1 (AVX2/FMA: 8
rows per q vector load, one transposing horizontal sum for 8 scores); then an exact softmax per
query vector over its own causal length (max, exp, sum; the scores of one sequence are a few
KiB); pass 2 walks the V blocks the same way, 3 query vectors x 32 dims of accumulators in
registers, so each V vector load feeds 3 FMAs
(its V blocks were requested into L2 during pass 1; the next block of each pass into L1). Work
is split over sequences (all their heads: each block is one contiguous read) or, with few
sequences, over (sequence, KV head) pairs, on ATen's thread pool. Without AVX2, or with a
head_dim that is not a multiple of 8, plain loops the compiler vectorises do the same passes.

The C++ is kernels/csrc/cpu_decode.cpp. It is built by `kernels/cpu_build.py` (a niced compile
in its own process, cached per CPU) and imported by `KERNEL.ready()`; `sluice worker` starts the
build in the background at start-up and `sluice bench engine` waits for it (kernels/native.py
lists every native kernel), as the kernel tests do (`KERNEL.build()`). Not built yet, not
buildable, or SLUICE_CPU_DECODE_KERNEL=0: the torch path runs; the kernel is a speed-up, never a
requirement. CUDA decodes use the Triton kernel instead (the model code is the same; only `Ops`
differs). Float32 only; the same arithmetic as the reference in another summation order
(rounding-level).
"""

from __future__ import annotations

import torch

from sluice.kernels.cpu_build import CSRC, NativeKernel

KERNEL = NativeKernel("sluice_cpu_paged_decode", CSRC / "cpu_decode.cpp", __name__,
                      switch="SLUICE_CPU_DECODE_KERNEL", entry_points=("paged_decode_cpu",))


_ONE_ROW_EACH = torch.empty(0, dtype=torch.int32)


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     query_start_loc: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] float32 -> [T, Hq, D]. Without `query_start_loc` one decode row per sequence
    (T == B); with it ([B + 1] int32), sequence b's rows are q[qsl[b]:qsl[b + 1]], its last tokens,
    each attending causally (a verification chunk). Call only if `KERNEL.ready()`."""
    assert KERNEL.module is not None
    starts = _ONE_ROW_EACH if query_start_loc is None else query_start_loc
    return KERNEL.module.paged_decode(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, starts, scale)
