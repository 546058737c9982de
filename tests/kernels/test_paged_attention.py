"""Triton paged attention (split-KV decode, varlen prefill, mixed dispatch) vs the torch loop
reference, on fresh random paged caches with scattered block ids and NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels.attention import paged_attention_ref
from sluice.kernels.ops import Ops, paged_attention_triton
from sluice.kernels.paged_decode import paged_decode_triton
from sluice.kernels.paged_prefill import paged_prefill_triton
from sluice.kernels.testing import make_paged_batch, rel_error, tolerance

pytestmark = pytest.mark.kernels

F32, BF16 = torch.float32, torch.bfloat16

# (block_size, q_heads, kv_heads, head_dim, dtype): every block size, GQA ratio (1, 4, 8),
# head dim (64, 80, 128) and dtype appears, without the full cross product.
SHAPES = [
    pytest.param(16, 4, 4, 64, F32, id="bs16-g1-d64-f32"),
    pytest.param(32, 8, 2, 80, BF16, id="bs32-g4-d80-bf16"),
    pytest.param(16, 8, 1, 128, F32, id="bs16-g8-d128-f32"),
    pytest.param(32, 2, 2, 128, BF16, id="bs32-g1-d128-bf16"),
    pytest.param(16, 8, 2, 80, F32, id="bs16-g4-d80-f32"),
    pytest.param(32, 16, 2, 64, BF16, id="bs32-g8-d64-bf16"),
]

DECODE_SEQS = [(1, 37), (1, 5), (1, 97), (1, 1)]
# A chunk behind a cached prefix spanning several blocks, a whole prompt, a short tail chunk.
PREFILL_SEQS = [(20, 70), (16, 16), (3, 40)]
MIXED_SEQS = [(1, 33), (18, 50), (1, 65), (5, 5)]


def _batch(seqs, block_size, hq, hkv, d, dtype, device, seed=0):
    return make_paged_batch(
        seqs, block_size=block_size, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
        device=device, seed=seed,
    )  # fmt: skip


def _reference(batch) -> torch.Tensor:
    d = batch.q.shape[-1]
    return paged_attention_ref(
        batch.q.cpu(), batch.k_cache.cpu(), batch.v_cache.cpu(), _cpu_meta(batch.meta), d**-0.5
    )


def _cpu_meta(meta):
    from dataclasses import replace

    return replace(
        meta,
        slot_mapping=meta.slot_mapping.cpu(),
        query_start_loc=meta.query_start_loc.cpu(),
        seq_lens=meta.seq_lens.cpu(),
        block_tables=meta.block_tables.cpu(),
    )


@pytest.mark.parametrize(("block_size", "hq", "hkv", "d", "dtype"), SHAPES)
@pytest.mark.parametrize("partition_size", [16, None], ids=["split", "whole"])
def test_decode_matches_reference(device, block_size, hq, hkv, d, dtype, partition_size) -> None:
    if device == "cuda" and partition_size is not None:
        partition_size = 64  # the CUDA tile is 64 tokens wide; 97 tokens still make 2 partitions
    batch = _batch(DECODE_SEQS, block_size, hq, hkv, d, dtype, device)
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, d**-0.5, out=out,
                        partition_size=partition_size)  # fmt: skip
    assert rel_error(out.cpu(), _reference(batch)) < tolerance(dtype)


def test_decode_reduces_more_partitions_than_one_chunk(device) -> None:
    """More partitions than the reduce kernel's chunk of 32: its two-pass loop must combine them."""
    partition = 64 if device == "cuda" else 16
    batch = _batch([(1, 33 * partition + 5), (1, 40)], 16, 4, 2, 64, F32, device, seed=4)
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_triton(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, out=out, partition_size=partition
    )
    assert rel_error(out.cpu(), _reference(batch)) < tolerance(F32)


@pytest.mark.parametrize(("block_size", "hq", "hkv", "d", "dtype"), SHAPES)
def test_prefill_matches_reference(device, block_size, hq, hkv, d, dtype) -> None:
    batch = _batch(PREFILL_SEQS, block_size, hq, hkv, d, dtype, device, seed=1)
    out = torch.full_like(batch.q, float("nan"))
    paged_prefill_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, d**-0.5, out=out)
    assert rel_error(out.cpu(), _reference(batch)) < tolerance(dtype)


@pytest.mark.parametrize(("block_size", "hq", "hkv", "d", "dtype"), SHAPES[:3])
def test_mixed_batch_dispatch_matches_reference(device, block_size, hq, hkv, d, dtype) -> None:
    """Prompt chunks through the prefill kernel, decodes through the decode kernel, one output."""
    batch = _batch(MIXED_SEQS, block_size, hq, hkv, d, dtype, device, seed=2)
    out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, d**-0.5)
    assert rel_error(out.cpu(), _reference(batch)) < tolerance(dtype)


def test_ops_triton_routes_decode_only_batches(device) -> None:
    batch = _batch(DECODE_SEQS, 16, 8, 2, 64, F32, device, seed=3)
    out = Ops("triton").paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    assert rel_error(out.cpu(), _reference(batch)) < tolerance(F32)


def test_rejects_bad_inputs() -> None:
    batch = _batch(DECODE_SEQS, 16, 6, 4, 64, F32, "cpu")  # 6 query heads over 4 KV heads
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.1)
    batch = _batch(DECODE_SEQS, 16, 4, 4, 64, F32, "cpu")
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_prefill_triton(batch.q.double(), batch.k_cache, batch.v_cache, batch.meta, 0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_triton(batch.q[:2], batch.k_cache, batch.v_cache, batch.meta, 0.1)
    with pytest.raises(ValueError, match="partition_size"):
        paged_decode_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.1, partition_size=24)
