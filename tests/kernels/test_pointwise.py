"""Fused residual+RMSNorm, SiLU-and-multiply and rotary+KV-store kernels vs their torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from sluice.kernels.linear import linear
from sluice.kernels.ops import Ops
from sluice.kernels.rmsnorm import rms_norm_ref, rms_norm_torch, rms_norm_triton
from sluice.kernels.rotary import rotary_store_kv_ref, rotary_store_kv_triton
from sluice.kernels.testing import make_metadata, rel_error, tolerance

pytestmark = pytest.mark.kernels

DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]


def _randn(*shape: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize("hidden", [64, 80, 256, 576, 4096])
@pytest.mark.parametrize("rows", [1, 7, 130])
def test_rms_norm_torch_is_bitwise_the_reference_in_float32(hidden: int, rows: int) -> None:
    """The CPU engine's fused rms_norm must not move a single bit (greedy exactness against HF)."""
    for seed in range(3):
        x = 3 * _randn(rows, hidden, dtype=torch.float32, device="cpu", seed=seed)
        residual = _randn(rows, hidden, dtype=torch.float32, device="cpu", seed=seed + 10)
        weight = 1 + 0.1 * _randn(hidden, dtype=torch.float32, device="cpu", seed=seed + 20)
        for res in (residual, None):
            out, new_residual = rms_norm_torch(x, weight, 1e-5, res)
            ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, res)
            assert torch.equal(out, ref_out) and torch.equal(new_residual, ref_residual)
    bf16 = _randn(rows, hidden, dtype=torch.bfloat16, device="cpu", seed=0)
    bf16_weight = torch.ones(hidden, dtype=torch.bfloat16)
    assert torch.equal(rms_norm_torch(bf16, bf16_weight, 1e-5)[0], rms_norm_ref(bf16, bf16_weight, 1e-5)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_rms_norm_matches_reference(device, dtype, with_residual) -> None:
    hidden = 80  # not a power of two: the tile is padded and masked
    x = _randn(7, hidden, dtype=dtype, device=device, seed=0)
    weight = 1 + 0.1 * _randn(hidden, dtype=dtype, device=device, seed=1)
    residual = _randn(7, hidden, dtype=dtype, device=device, seed=2) if with_residual else None
    out, new_residual = rms_norm_triton(x, weight, 1e-6, residual)
    ref_out, ref_residual = rms_norm_ref(
        x.cpu(), weight.cpu(), 1e-6, None if residual is None else residual.cpu()
    )
    assert out.dtype == ref_out.dtype
    assert rel_error(out.cpu(), ref_out) < tolerance(dtype)
    assert rel_error(new_residual.cpu(), ref_residual) < tolerance(dtype)


def test_rms_norm_through_ops_and_strided_rows(device) -> None:
    base = _randn(5, 192, dtype=torch.float32, device=device, seed=3)
    x = base[:, :96]  # row stride 192: a view, as after a split
    weight = _randn(96, dtype=torch.float32, device=device, seed=4)
    out, _ = Ops("triton").rms_norm(x, weight, 1e-5)
    ref, _ = rms_norm_ref(x.cpu(), weight.cpu(), 1e-5)
    assert rel_error(out.cpu(), ref) < tolerance(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(device, dtype) -> None:
    x = _randn(6, 2 * 200, dtype=dtype, device=device, seed=5)
    out = silu_and_mul_triton(x, block_i=64)  # 200 = 3 full tiles + a masked one
    assert rel_error(out.cpu(), silu_and_mul_ref(x.cpu())) < tolerance(dtype)
    assert rel_error(Ops("triton").silu_and_mul(x).cpu(), silu_and_mul_ref(x.cpu())) < tolerance(dtype)


@pytest.mark.parametrize(
    ("block_size", "hq", "hkv", "head_dim", "dtype"),
    [
        pytest.param(16, 8, 2, 64, torch.float32, id="bs16-d64-f32"),
        pytest.param(32, 4, 4, 80, torch.bfloat16, id="bs32-d80-bf16"),
        pytest.param(16, 8, 1, 128, torch.bfloat16, id="bs16-d128-bf16"),
    ],
)
def test_rotary_store_kv_matches_reference(device, block_size, hq, hkv, head_dim, dtype) -> None:
    meta, positions, num_blocks = make_metadata([(3, 40), (1, 7), (5, 5)], block_size, device)
    num_tokens = positions.shape[0]
    # q, k, v as views of one fused projection, as the model produces them.
    qkv = _randn(num_tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, device=device, seed=6)
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    # float32 rope table whatever the activation dtype, as the model keeps it.
    cos_sin = _randn(64, head_dim, dtype=torch.float32, device=device, seed=7)
    shape = (num_blocks, block_size, hkv, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    ref_k_cache, ref_v_cache = k_cache.cpu().clone(), v_cache.cpu().clone()

    q_rot, k_rot = rotary_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
    ref_q, ref_k = rotary_store_kv_ref(
        q.cpu(), k.cpu(), v.cpu(), positions.cpu(), cos_sin.cpu(), ref_k_cache, ref_v_cache,
        meta.slot_mapping.cpu(),
    )  # fmt: skip
    assert rel_error(q_rot.cpu(), ref_q) < tolerance(dtype)
    assert rel_error(k_rot.cpu(), ref_k) < tolerance(dtype)
    slots = meta.slot_mapping.cpu()
    for cache, ref_cache in ((k_cache, ref_k_cache), (v_cache, ref_v_cache)):
        written = cache.cpu().view(-1, hkv, head_dim)
        expected = ref_cache.view(-1, hkv, head_dim)
        assert rel_error(written[slots], expected[slots]) < tolerance(dtype)
        untouched = torch.ones(written.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert written[untouched].isnan().all(), "the kernel wrote cache slots outside slot_mapping"


def _hf_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on one tensor: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * torch.cat((cos, cos), dim=-1) + torch.cat((-x2, x1), dim=-1) * torch.cat((sin, sin), dim=-1)


@pytest.mark.parametrize(("hq", "hkv", "head_dim"), [(9, 3, 64), (8, 2, 80)])
@pytest.mark.parametrize("fused", [True, False], ids=["qkv-views", "separate"])
def test_rotary_store_kv_ref_is_bitwise_hf_in_float32(hq: int, hkv: int, head_dim: int, fused: bool) -> None:
    """The CPU path rotates q and k in place of one view when they are adjacent columns of the
    fused projection, else through a copy; either way float32 results are HF's bits."""
    meta, positions, num_blocks = make_metadata([(3, 40), (1, 7), (5, 5)], 16, "cpu")
    num_tokens = positions.shape[0]
    qkv = 3 * _randn(num_tokens, (hq + 2 * hkv) * head_dim, dtype=torch.float32, device="cpu", seed=11)
    q, k, v = (t.view(num_tokens, -1, head_dim)
               for t in qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=1))
    if not fused:
        q, k, v = q.clone(), k.clone(), v.clone()
    cos_sin = _randn(64, head_dim, dtype=torch.float32, device="cpu", seed=12)
    caches = [torch.zeros(num_blocks, 16, hkv, head_dim) for _ in range(2)]
    q_rot, k_rot = rotary_store_kv_ref(q, k, v, positions, cos_sin, *caches, meta.slot_mapping)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    assert torch.equal(q_rot, _hf_rotate(q, cos, sin)) and torch.equal(k_rot, _hf_rotate(k, cos, sin))
    slots = meta.slot_mapping
    assert torch.equal(caches[0].view(-1, hkv, head_dim)[slots], k_rot)
    assert torch.equal(caches[1].view(-1, hkv, head_dim)[slots], v)
    assert torch.equal(qkv[:, :hq * head_dim].view(num_tokens, hq, head_dim), q) or not fused  # inputs kept


@pytest.mark.parametrize("rows", [1, 7, 130, 600])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (64, 49)])
def test_linear_matches_f_linear(rows: int, in_features: int, out_features: int) -> None:
    """The CPU float32 projection (oneDNN) is F.linear up to float32 summation order; bf16 and
    odd shapes take F.linear itself."""
    x = _randn(rows, in_features, dtype=torch.float32, device="cpu", seed=rows)
    weight = _randn(out_features, in_features, dtype=torch.float32, device="cpu", seed=1) / in_features ** 0.5
    bias = _randn(out_features, dtype=torch.float32, device="cpu", seed=2)
    for b in (bias, None):
        out = linear(x, weight, b)
        assert out.shape == (rows, out_features) and out.dtype == torch.float32
        assert rel_error(out, F.linear(x, weight, b)) < 1e-5
    assert rel_error(linear(x[:, ::2], weight[:, ::2]), F.linear(x[:, ::2], weight[:, ::2])) < 1e-5  # strided
    xb, wb = x.bfloat16(), weight.bfloat16()
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))


def test_validation_errors_are_user_readable() -> None:
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm_triton(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm_triton(x, torch.ones(16), 1e-6, torch.randn(3, 8))
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul_triton(torch.randn(3, 7))
    meta, positions, num_blocks = make_metadata([(2, 2)], 16)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    cache = torch.zeros(num_blocks, 16, 2, 64)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_store_kv_triton(q, k, k, positions, torch.randn(8, 32), cache, cache, meta.slot_mapping)
    with pytest.raises(ValueError, match="k_cache"):
        rotary_store_kv_triton(
            q, k, k, positions, torch.randn(8, 64), cache[:, :, :1], cache, meta.slot_mapping
        )


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        rms_norm_triton(torch.randn(2, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        Ops("triton").silu_and_mul(torch.randn(2, 8))
