"""The native CPU glue kernels (kernels/cpu_glue.py) against the torch references they replace.

The `built` fixture (conftest.py) builds the kernels with warnings as errors; the tests skip
where no compiler is available.
"""

from __future__ import annotations

import pytest
import torch

from sluice.kernels import cpu_glue
from sluice.kernels.activation import silu_and_mul_ref
from sluice.kernels.ops import Ops
from sluice.kernels.rmsnorm import rms_norm_torch
from sluice.kernels.rotary import rope_rows, rotary_store_kv_ref

pytestmark = [pytest.mark.kernels, pytest.mark.timeout(1800)]


NATIVE_KERNEL = cpu_glue.KERNEL  # built by the `built` fixture (conftest.py)


@pytest.mark.parametrize("hidden", [576, 37, 64, 1000])
@pytest.mark.parametrize("rows", [1, 3, 130])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(built: None, threads: int, hidden: int, rows: int, with_residual: bool) -> None:
    """The residual sum is bitwise the reference's; the normed rows within rounding (the mean of
    squares is summed in another order than torch's reduction)."""
    gen = torch.Generator().manual_seed(hidden * rows)
    x = torch.randn(rows, 2 * hidden, generator=gen)[:, :hidden]  # strided rows, as a split gives
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    weight = torch.randn(hidden, generator=gen)
    want, want_res = rms_norm_torch(x, weight, 1e-5, residual)
    got, got_res = cpu_glue.add_rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size"), [(9, 3, 64, 16), (4, 4, 32, 1), (6, 2, 10, 4)])
@pytest.mark.parametrize("tokens", [1, 5, 77])
def test_rotary_store_kv_is_bitwise_the_reference(built: None, threads: int, hq: int, hkv: int, head_dim: int,
                                                  block_size: int, tokens: int) -> None:
    """Both entries (q/k/v views and the fused qkv rows) give the reference's bits for q, k and
    both caches, with slots scattered across blocks."""
    gen = torch.Generator().manual_seed(hq * 1000 + tokens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=gen) * 4
    q, k, v = qkv.split((hq * head_dim, hkv * head_dim, hkv * head_dim), dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos_sin = torch.randn(4096, head_dim, generator=gen)
    num_blocks = tokens // block_size + 8
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    caches = [torch.zeros(num_blocks, block_size, hkv, head_dim) for _ in range(6)]
    rope = rope_rows(positions, cos_sin)
    want_q, want_k = rotary_store_kv_ref(q, k, v, positions, cos_sin, caches[0], caches[1], slots, rope)
    got_q, got_k = cpu_glue.rotary_store_kv(q, k, v, rope, caches[2], caches[3], slots)
    fused_q = cpu_glue.qkv_rotary_store(qkv, hq, hkv, head_dim, rope, caches[4], caches[5], slots)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(fused_q, want_q)
    for i in (2, 4):
        assert torch.equal(caches[i], caches[0]) and torch.equal(caches[i + 1], caches[1])


def test_rotary_store_kv_skips_padding_slots(built: None) -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (2 + 2) * 8, generator=gen)
    cos_sin = torch.randn(16, 8, generator=gen)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    cpu_glue.qkv_rotary_store(qkv, 2, 1, 8, rope_rows(torch.tensor([0, 1, 2]), cos_sin), k_cache, v_cache,
                              torch.tensor([5, -1, 0]))
    assert k_cache.view(8, 8).abs().sum(-1).nonzero().flatten().tolist() == [0, 5]
    assert torch.equal(v_cache.view(8, 8)[5], qkv[0, 24:])


@pytest.mark.parametrize("intermediate", [1536, 1, 17, 40, 100])
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_silu_and_mul_matches_torch(built: None, threads: int, intermediate: int, rows: int) -> None:
    """torch's exp on torch's element ranges: bitwise the reference (on a build whose ISA is
    torch's dispatch level; else within rounding)."""
    gen = torch.Generator().manual_seed(intermediate + rows)
    x = torch.randn(rows, 2 * intermediate, generator=gen) * 6
    want, got = silu_and_mul_ref(x), cpu_glue.silu_and_mul(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_ops_dispatch_and_switch(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ops('torch') decides once per step: the native path for float32 CPU activations and K/V,
    the torch path for other dtypes or with the switch off."""
    ops = Ops("torch")
    x = torch.randn(4, 64)
    weight = torch.randn(64)
    ops.begin_step(x, torch.float32)
    assert ops._native_glue
    got = ops.rms_norm(x, weight, 1e-6)[0]
    torch.testing.assert_close(got, rms_norm_torch(x, weight, 1e-6)[0])
    wide = x.double()
    ops.begin_step(wide, torch.float64)
    assert not ops._native_glue
    torch.testing.assert_close(ops.rms_norm(wide, weight.double(), 1e-6)[0],
                               rms_norm_torch(wide, weight.double(), 1e-6)[0])
    assert ops.silu_and_mul(wide).dtype == torch.float64
    ops.begin_step(x, torch.bfloat16)  # a float32 model over a bfloat16 cache: the torch path
    assert not ops._native_glue
    monkeypatch.setenv("SLUICE_CPU_GLUE_KERNEL", "0")
    assert not cpu_glue.KERNEL.ready()
    ops.begin_step(x, torch.float32)
    assert not ops._native_glue
    assert not Ops("triton")._native_glue
