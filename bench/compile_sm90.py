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


def _decode(*, split: bool, page_size: int = 16, block_n: int = 64, f32: bool = False, num_stages: int = 3):
    """The split-KV decode kernel: a GQA group of 4 query heads padded to 16 rows, head_dim 128."""
    types, dot = (_F32_ATTN, _F32_DOT) if f32 else (_PAGED_TYPES, _BF16_DOT)
    constexprs = {"PAGE_SIZE": page_size, "BLOCK_G": 16, "BLOCK_N": block_n, "BLOCK_D": 128, "SPLIT": split}
    return (_paged_decode_kernel, types, {**constexprs, **dot}, 4, num_stages)


def _prefill(*, skip_decodes: bool, block_m: int = 64, num_warps: int = 4, num_stages: int = 2):
    """The varlen prefill kernel, bf16, head_dim 128."""
    constexprs = {"PAGE_SIZE": 16, "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_D": 128, "SKIP_DECODES": skip_decodes}
    return (_paged_prefill_kernel, _PAGED_TYPES, {**constexprs, **_BF16_DOT}, num_warps, num_stages)


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
    _decode(split=True),
    _decode(split=False, page_size=32),
    _decode(split=True, f32=True),
    (_paged_decode_reduce_kernel, _PAGED_TYPES, {"BLOCK_P": 16, "BLOCK_D": 128}, 4, 3),
    _prefill(skip_decodes=True),
    _prefill(skip_decodes=False),
    # Shapes bench/gpu_suite.py sweeps.
    _prefill(skip_decodes=False, block_m=128, num_warps=8, num_stages=3),
    _decode(split=True, block_n=128, num_stages=2),
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
