"""Compile every Triton kernel variant for Hopper (sm_90) on a machine without a GPU.

  python3 bench/compile_sm90.py

Triton's compiler and its bundled ptxas run without a device, so this catches GPU-only compile
errors (types across loop iterations, dot shapes, constexpr branches) before device time is
spent, and prints what the compiler chose: shared memory, and whether the dots became mma
(Ampere-style) or wgmma (Hopper) instructions. Exit status: 0 all compiled, 1 a kernel failed,
3 this Triton has another ahead-of-time API (nothing was checked).
Must run without TRITON_INTERPRET, which replaces @triton.jit kernels by interpreted ones.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton

from sluice.kernels.activation import _silu_and_mul_kernel
from sluice.kernels.paged_decode import _paged_decode_kernel, _paged_decode_reduce_kernel
from sluice.kernels.paged_prefill import _paged_prefill_kernel
from sluice.kernels.rmsnorm import _rms_norm_kernel
from sluice.kernels.rotary import _rotary_store_kv_kernel

# Pointer arguments default to bf16, other arguments to i32; these are the exceptions.
_PAGED_TYPES = {
    "block_tables_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "part_out_ptr": "*fp32",
    "part_max_ptr": "*fp32",
    "part_sum_ptr": "*fp32",
    "qk_scale": "fp32",
}
_F32_ATTN = {
    **_PAGED_TYPES,
    "q_ptr": "*fp32",
    "k_cache_ptr": "*fp32",
    "v_cache_ptr": "*fp32",
    "out_ptr": "*fp32",
}
_BF16_DOT = {"DOT_PRECISION": "tf32", "UPCAST_DOT": False}
_F32_DOT = {"DOT_PRECISION": "ieee", "UPCAST_DOT": False}

# (kernel, argument types, constexprs, num_warps, num_stages), as the launchers pick them for
# Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128, hidden 4096) and head_dim 80.
VARIANTS = [
    (_rms_norm_kernel, {"eps": "fp32"}, {"HAS_RESIDUAL": True, "BLOCK_H": 4096}, 16, 3),
    (_rms_norm_kernel, {"eps": "fp32"}, {"HAS_RESIDUAL": False, "BLOCK_H": 4096}, 16, 3),
    (_silu_and_mul_kernel, {}, {"BLOCK_I": 1024}, 4, 3),
    (
        _rotary_store_kv_kernel,
        {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_mapping_ptr": "*i64"},
        {"BLOCK_Q_HEADS": 32, "BLOCK_KV_HEADS": 8, "BLOCK_HALF": 64},
        4,
        3,
    ),
    (
        _paged_decode_kernel,
        _PAGED_TYPES,
        {"PAGE_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128, "SPLIT": True, **_BF16_DOT},
        4,
        3,
    ),
    (
        _paged_decode_kernel,
        _PAGED_TYPES,
        {"PAGE_SIZE": 32, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128, "SPLIT": False, **_BF16_DOT},
        4,
        3,
    ),
    (
        _paged_decode_kernel,
        _F32_ATTN,
        {"PAGE_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128, "SPLIT": True, **_F32_DOT},
        4,
        3,
    ),
    (_paged_decode_reduce_kernel, _PAGED_TYPES, {"BLOCK_P": 16, "BLOCK_D": 128}, 4, 3),
    (
        _paged_prefill_kernel,
        _PAGED_TYPES,
        {"PAGE_SIZE": 16, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128, "SKIP_DECODES": True, **_BF16_DOT},
        4,
        2,
    ),
    (
        _paged_prefill_kernel,
        _PAGED_TYPES,
        {"PAGE_SIZE": 16, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128, "SKIP_DECODES": False, **_BF16_DOT},
        4,
        2,
    ),
    # Shapes bench/gpu_suite.py sweeps.
    (
        _paged_prefill_kernel,
        _PAGED_TYPES,
        {"PAGE_SIZE": 16, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 128, "SKIP_DECODES": False, **_BF16_DOT},
        8,
        3,
    ),
    (
        _paged_decode_kernel,
        _PAGED_TYPES,
        {"PAGE_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": 128, "BLOCK_D": 128, "SPLIT": True, **_BF16_DOT},
        4,
        2,
    ),
]


def _signature(kernel, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        return types.get(name, "*bf16" if name.endswith("_ptr") else "i32")

    return {name: kind(name) for name in kernel.arg_names}


def main() -> int:
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print(f"this Triton ({triton.__version__}) has another ahead-of-time API: {exc}")
        return 3
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for kernel, types, constexprs, num_warps, num_stages in VARIANTS:
        flags = " ".join(f"{k}={v}" for k, v in constexprs.items())
        started = time.perf_counter()
        try:
            source = ASTSource(kernel, _signature(kernel, types, constexprs), constexprs=constexprs)
        except TypeError as exc:
            print(f"this Triton ({triton.__version__}) has another ASTSource signature: {exc}")
            return 3
        try:
            compiled = triton.compile(
                source, target=target, options={"num_warps": num_warps, "num_stages": num_stages}
            )
        except Exception as exc:  # report every variant, then fail
            failed += 1
            print(f"FAIL {kernel.__name__} [{flags}]: {type(exc).__name__}: {exc}")
            continue
        ptx = compiled.asm["ptx"]
        print(
            f"ok   {kernel.__name__} [{flags}] {time.perf_counter() - started:.1f}s "
            f"shared={compiled.metadata.shared}B wgmma={ptx.count('wgmma.mma_async')} "
            f"mma={ptx.count('mma.sync')} local_mem={'.local' in ptx}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
