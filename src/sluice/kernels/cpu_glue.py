"""Native CPU versions of a decoder layer's small ops: residual add + RMSNorm, rotary + K/V store,
SiLU(gate) * up. One C++ call each instead of several torch ops (and their Python dispatch).

In a 1-sequence decode step these ops are few microseconds of arithmetic but cost 3-6x their
hot-cache time, because the weight stream of the GEMMs between them evicts their code and data;
each torch op also pays its own dispatch. Fewer calls is the lever: one pass per op over rows that
are still in L1, no intermediate tensors, and `at::parallel_for` over rows so a prefill's
elementwise work uses every intra-op thread (torch's small pointwise ops ran on one).

Exactness against the torch references (and so HF's float32 bits):
- rotary: x1 * cos - x2 * sin and x2 * cos + x1 * sin with each product rounded on its own, as
  the reference and HF do: kernels/csrc/cpu_glue.cpp turns fp-contract off (GCC's default for C++
  would fuse them into FMAs) and the products are separate statements (what clang contracts).
  Bitwise equal to `rotary_store_kv_ref`.
- SiLU: torch's own formula x / (1 + exp(-x)) with the exp torch's CPU kernel uses: SLEEF's
  expf (1 ulp), 16 or 8 lanes as torch's dispatch level (AVX512 or AVX2), on the same element
  ranges torch's vectorised loop covers (its tail uses libm's expf, as here). Bitwise equal to
  `silu_and_mul_ref` where the build's ISA matches torch's dispatch level.
- RMSNorm: the residual add and the final (x * rsqrt) * weight are the same roundings; the mean
  of squares is summed in another order than torch's reduction (rounding-level, not bitwise).

The C++ is kernels/csrc/cpu_glue.cpp, built and loaded like kernels/cpu_decode.py (a niced compile
in its own process, cached per CPU); not built yet, not buildable, or SLUICE_CPU_GLUE_KERNEL=0: `Ops`
runs the torch path. Float32 CPU tensors only; `Ops` checks that before calling in.
"""

from __future__ import annotations

import torch

from sluice.kernels.cpu_build import CSRC, NativeKernel

KERNEL = NativeKernel("sluice_cpu_glue", CSRC / "cpu_glue.cpp", __name__, switch="SLUICE_CPU_GLUE_KERNEL",
                      entry_points=("add_rms_norm", "rotary_store_kv", "qkv_rotary_store", "silu_and_mul"))

# torch's Vectorized<float> width at its dispatch level: SiLU takes the same exp on the same ranges.
_LANES = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 0)


# The wrappers below: float32 CPU tensors only, and only once `KERNEL.ready()` (Ops checks both, once a step).

def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (normed [T, H], x + residual), as `rmsnorm.rms_norm_torch`."""
    assert KERNEL.module is not None
    out, new_residual = KERNEL.module.add_rms_norm(x, residual, weight, eps)
    return out, new_residual


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As `rotary.rotary_store_kv_ref` with the step's `rope` rows: returns (q, k) rotated."""
    assert KERNEL.module is not None
    q_rot, k_rot = KERNEL.module.rotary_store_kv(q, k, v, rope[0], rope[1], k_cache, v_cache, slot_mapping)
    return q_rot, k_rot


def qkv_rotary_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) D] -> rotated q [T, Hq, D]; rotated k and v go into their cache slots."""
    assert KERNEL.module is not None
    q_rot: torch.Tensor = KERNEL.module.qkv_rotary_store(qkv, num_heads, num_kv_heads, head_dim, rope[0], rope[1],
                                                          k_cache, v_cache, slot_mapping)
    return q_rot


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] holding [gate | up] -> silu(gate) * up: [T, I], as `activation.silu_and_mul_ref`."""
    assert KERNEL.module is not None
    out: torch.Tensor = KERNEL.module.silu_and_mul(x, _LANES)
    return out
