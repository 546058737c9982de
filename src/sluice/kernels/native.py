"""sluice's native CPU kernels as one set: what a worker builds at start-up and a bench before timing.

Each kernel module (`cpu_decode`, `cpu_gemv`, `cpu_glue`, `cpu_grammar_mask`, `cpu_prefill`) holds one `NativeKernel`
(kernels/cpu_build.py) of its C++ file in kernels/csrc/; callers that use a kernel ask its
`KERNEL.ready()`, and those that build them all go through here, so a new kernel is listed once.
"""

from __future__ import annotations

from sluice.kernels import cpu_decode, cpu_gemv, cpu_glue, cpu_grammar_mask, cpu_prefill
from sluice.kernels.cpu_build import NativeKernel

# Report key (as in the bench JSON's config) -> kernel.
KERNELS: dict[str, NativeKernel] = {
    "cpu_decode_kernel": cpu_decode.KERNEL,  # decode attention, gather-free
    "cpu_gemv_kernel": cpu_gemv.KERNEL,  # projections of 1-4 rows, weight-streaming
    "cpu_glue_kernel": cpu_glue.KERNEL,  # residual + RMSNorm, rotary + K/V store, SiLU * up
    "cpu_grammar_mask_kernel": cpu_grammar_mask.KERNEL,  # grammar masks of constrained rows
    "cpu_prefill_kernel": cpu_prefill.KERNEL,  # prompt chunks' causal attention
}


def build_all(*, compile_missing: bool = True) -> dict[str, bool]:
    """Builds (waiting for each compile) and loads every kernel; with compile_missing=False only
    loads those already built. Returns which are ready."""
    return {key: kernel.build() if compile_missing else kernel.ready() for key, kernel in KERNELS.items()}


def build_all_in_background() -> None:
    """Starts the builds without waiting (a worker at start-up); the torch path runs meanwhile."""
    for kernel in KERNELS.values():
        kernel.build_in_background()
