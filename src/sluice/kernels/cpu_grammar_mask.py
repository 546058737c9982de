"""Grammar token masks applied on the CPU in one native call (structured outputs, issue #31).

A constrained row's mask is llguidance's bitmask, int32 words [ceil(V / 32)]; blocked tokens get
-inf. The torch path (workers/grammar_mask.py, `apply_bitmask`) needs a dozen ops per step (word
tests, nonzero, index gathers, an unpacked [rows, V] boolean for mostly-allowed rows) and a copy
in and out when only some rows are constrained; on a loaded 2-core host each op also pays its
OpenMP hand-off, and the apply took ~0.25 ms per row. The kernel reads each row's words once,
skips all-ones words, writes 32 plain -inf stores for an all-zeros word and tests bits only in
mixed words, writing straight into the rows it is given. An allowed logit is never written, so it
keeps its bits exactly (the result equals `apply_bitmask`, tests/kernels/test_cpu_grammar_mask.py).
One thread: the pass is memory-bound, and a split over OpenMP threads was 9x slower at 64 rows on
the loaded 2-core host (the region waits for its descheduled thread).

The C++ is kernels/csrc/cpu_grammar_mask.cpp, built and loaded like kernels/cpu_decode.py
(kernels/native.py lists it); not built yet, or SLUICE_CPU_GRAMMAR_MASK_KERNEL=0: the torch path.
Float32 contiguous CPU logits only; `workers/grammar_mask.apply_bitmask_to_rows` checks.
"""

from __future__ import annotations

import torch

from sluice.kernels.cpu_build import CSRC, NativeKernel

KERNEL = NativeKernel("sluice_cpu_grammar_mask", CSRC / "cpu_grammar_mask.cpp", __name__,
                      switch="SLUICE_CPU_GRAMMAR_MASK_KERNEL", entry_points=("apply_token_bitmask",))


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [N, V] float32 contiguous CPU, in place; rows [K] int64; bitmask [K, ceil(V / 32)]
    int32: bitmask row k masks logits row rows[k]. Call once `KERNEL.ready()`."""
    assert KERNEL.module is not None
    KERNEL.module.apply_token_bitmask(logits, rows, bitmask)
