"""The CPU's causal paged prefill kernel (kernels/cpu_prefill.py) against the torch reference.

The `built` fixture (conftest.py) builds the kernel with warnings as errors; the tests skip
where no compiler is available.
"""

from __future__ import annotations

import pytest
import torch

from sluice.kernels import cpu_decode, cpu_prefill
from sluice.kernels.attention import paged_attention_ref, paged_attention_torch
from sluice.kernels.testing import make_paged_batch, poisoned_allocations

pytestmark = [pytest.mark.kernels, pytest.mark.timeout(1800)]


NATIVE_KERNEL = cpu_prefill.KERNEL  # built by the `built` fixture (conftest.py)


def _pieces(seqs: list[tuple[int, int]]) -> torch.Tensor:
    """Every sequence with query rows as one piece: (sequence, first token row, rows, context)."""
    spec, start = [], 0
    for b, (q_len, seq_len) in enumerate(seqs):
        if q_len:
            spec.append((b, start, q_len, seq_len))
        start += q_len
    return torch.tensor(spec, dtype=torch.int64)


# (query heads, KV heads, head_dim, block size): the real model (GQA 3, D 64: the AVX-512 path
# where the CPU has it), no GQA, GQA 4, head dims that are a multiple of 8 but not 16 (40: the
# AVX2 path), of neither (20, 36: the plain loops), block sizes 1 to 32 and odd (5, 7).
SHAPES = [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 40, 7), (8, 2, 128, 32), (6, 3, 20, 5), (4, 1, 36, 1),
          (12, 3, 64, 16)]

# (query rows, context length) per sequence: whole prompts (ragged, a single row, one key tile
# exactly, a tile and one), chunks after cached context (a 256-row chunk after 256 cached rows,
# short chunks after long contexts), and a mix of several sequences with decodes among them.
BATCHES = [
    [(512, 512)],
    [(256, 512)],
    [(1, 1), (2, 2), (33, 33), (64, 64), (65, 65), (17, 17)],
    [(5, 300), (100, 101), (3, 700), (48, 48)],
    [(1, 40), (37, 60), (1, 3), (130, 250), (1, 16), (7, 7)],
]


@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_prefill_matches_reference(built: None, hq: int, hkv: int, head_dim: int, block_size: int,
                                       threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, seqs in enumerate(BATCHES):
            batch = make_paged_batch(seqs, block_size=block_size, num_q_heads=hq, num_kv_heads=hkv,
                                     head_dim=head_dim, seed=i * 7 + head_dim)
            scale = head_dim ** -0.5
            ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
            out = torch.full_like(batch.q, float("nan"))
            cpu_prefill.paged_prefill_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                                          _pieces(seqs), scale, out)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_only_the_named_pieces_are_written(built: None) -> None:
    """A piece list that leaves some rows out (decodes of a mixed batch) leaves those rows alone."""
    seqs = [(20, 50), (1, 9), (30, 30)]
    batch = make_paged_batch(seqs, block_size=16, num_q_heads=9, num_kv_heads=3, head_dim=64)
    out = torch.full_like(batch.q, 7.0)
    pieces = _pieces(seqs)
    cpu_prefill.paged_prefill_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                                  pieces[pieces[:, 2] > 1], 0.125, out)
    assert torch.equal(out[20], torch.full_like(out[20], 7.0))
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(out[:20], ref[:20], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[21:], ref[21:], rtol=1e-5, atol=1e-5)


def test_the_torch_backend_sends_chunks_to_the_kernel(built: None) -> None:
    """A mixed batch: the chunks go to the prefill kernel (no padded groups left for them), the
    decodes to the decode kernel where it is built, with the short chunk (5 rows: a decode with its
    drafts); every row is written and equals the reference."""
    seqs = [(1, 40), (17, 60), (1, 3), (200, 250), (5, 5), (1, 16)]
    batch = make_paged_batch(seqs, block_size=16, num_q_heads=9, num_kv_heads=3, head_dim=64)
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    with poisoned_allocations():
        out = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (plan,) = batch.meta.plan_cache.values()
    short_chunk = [] if cpu_decode.KERNEL.ready() else [[4, 219, 5, 5]]
    assert plan.prefill is not None and plan.prefill.tolist() == [[1, 1, 17, 60], [3, 19, 200, 250], *short_chunk]
    assert all(group.rows_per_piece == 1 for group in plan.groups)  # decodes only, if any
    assert (plan.native is not None) == cpu_decode.KERNEL.ready()


def test_the_switch_turns_the_kernel_off(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """SLUICE_CPU_PREFILL_KERNEL=0: the chunks take the padded SDPA groups as before."""
    monkeypatch.setenv("SLUICE_CPU_PREFILL_KERNEL", "0")
    assert not cpu_prefill.KERNEL.ready()
    # an earlier test in this process may have built it in the background: what counts is that
    # no new build starts while the switch is off
    before = cpu_prefill.KERNEL._building
    cpu_prefill.KERNEL.build_in_background()  # does nothing while off
    assert cpu_prefill.KERNEL._building is before
    batch = make_paged_batch([(1, 40), (30, 39)], block_size=16, num_q_heads=9, num_kv_heads=3, head_dim=64)
    out = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    (plan,) = batch.meta.plan_cache.values()
    assert plan.prefill is None and any(group.rows_per_piece == 30 for group in plan.groups)
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_bad_pieces_are_refused(built: None) -> None:
    batch = make_paged_batch([(10, 20)], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=32)
    out = torch.empty_like(batch.q)
    for bad in ([0, 0, 10, 40], [0, 5, 10, 20], [1, 0, 10, 20], [0, 0, 10, 5]):
        with pytest.raises(RuntimeError, match="piece out of range"):
            cpu_prefill.paged_prefill_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                                          torch.tensor([bad]), 0.125, out)
