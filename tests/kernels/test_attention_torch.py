"""The batched torch attention (the CPU engine's hot path) against the per-sequence reference."""

from __future__ import annotations

import pytest
import torch

from sluice.kernels import attention
from sluice.kernels.attention import paged_attention_ref, paged_attention_torch
from sluice.kernels.ops import Ops
from sluice.kernels.testing import make_paged_batch

pytestmark = pytest.mark.kernels

CASES = {
    "decode": [(1, 37), (1, 5), (1, 64), (1, 100), (1, 1)],
    "prefill": [(20, 50), (16, 16), (3, 40)],
    "mixed": [(1, 17), (20, 50), (1, 33), (16, 16), (3, 90), (1, 1)],
}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 80), (16, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_batched_matches_loop_reference(
    kind: str, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    batch = make_paged_batch(
        CASES[kind],
        block_size=block_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    scale = head_dim**-0.5
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    out = Ops("torch").paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_small_budget_splits_groups_without_changing_results(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_paged_batch(CASES["mixed"], block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64)
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    monkeypatch.setattr(attention, "_GROUP_ELEMENT_BUDGET", 1)  # one query row per group
    out = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_long_chunk_is_split_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk whose scores alone exceed the budget is cut into row slices with the right causal span."""
    batch = make_paged_batch([(40, 70), (1, 9)], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=32)
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    monkeypatch.setattr(attention, "_GROUP_ELEMENT_BUDGET", 4 * 70 * 7 + 2 * 70 * 2 * 32)  # 7 rows per piece
    out = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_bf16_inputs_accumulate_in_float32() -> None:
    batch = make_paged_batch(
        CASES["mixed"], block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
    )
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    out = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=1e-2)


def test_decodes_of_very_different_lengths_are_bucketed_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short contexts are not padded to the longest: decodes split into length buckets, same result
    (the torch path's own groups: the native CPU decode kernel, which would take the decodes, is off)."""
    monkeypatch.setenv("SLUICE_CPU_DECODE_KERNEL", "0")
    lengths = [3, 400, 17, 390, 16, 385, 33, 200, 1, 210, 64, 5]
    batch = make_paged_batch([(1, n) for n in lengths] + [(9, 60)], block_size=16, num_q_heads=8,
                             num_kv_heads=2, head_dim=32)
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.17)
    out = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.17)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    (plan,) = batch.meta.plan_cache.values()
    decode_groups = [g for g in plan.groups if g.rows_per_piece == 1]
    assert len(decode_groups) >= 2
    assert sum(g.num_pieces for g in decode_groups) == len(lengths)


def _decode_pieces(lengths: list[int]) -> list[attention._Piece]:
    return [attention._Piece(seq=i, token_start=i, num_rows=1, context_len=n) for i, n in enumerate(lengths)]


def test_bucketing_covers_every_piece_once_longest_first() -> None:
    lengths = [5, 700, 33, 650, 18, 90, 1, 1024, 300, 16, 17, 512]
    groups = attention._bucket_by_length(_decode_pieces(lengths), block_size=16, kv_row_elements=64)
    flat = [p for g in groups for p in g]
    assert sorted(p.seq for p in flat) == list(range(len(lengths)))
    assert [p.context_len for p in flat] == sorted(lengths, reverse=True)
    assert len(groups) > 1


def test_bucketing_keeps_similar_lengths_together() -> None:
    """Padding a couple of blocks costs less than another group: these lengths stay one group."""
    pieces = _decode_pieces([97, 100, 120, 130, 140])
    groups = attention._bucket_by_length(pieces, block_size=16, kv_row_elements=64)
    assert groups == [pieces]  # one group, in token order: the decode-only fast path still applies
    assert attention._bucket_by_length([], block_size=16, kv_row_elements=64) == []
