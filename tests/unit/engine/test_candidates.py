"""The candidate sampler (workers/candidates.py) against the full sort it shortcuts."""

from __future__ import annotations

import pytest
import torch

from sluice.workers.candidates import CANDIDATE_TIERS, sample_from_candidates
from sluice.workers.sampler import _sample_sorted, uniform


def _rows(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits from peaked (chat-like) to flat: each row a different scale."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.3, 12.0, n)[:, None]
    return torch.randn(n, vocab, generator=gen) * scales


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(0, 0.95, 0.0), (0, 1.0, 0.0), (40, 0.9, 0.0),
                                                      (0, 0.8, 0.05), (5000, 0.95, 0.0), (1, 1.0, 0.0),
                                                      (1000, 1.0, 0.0)])
def test_same_tokens_as_the_full_sort(top_k: int, top_p: float, min_p: float) -> None:
    n, vocab = 64, 6000
    scaled = _rows(n, vocab, seed=top_k + int(top_p * 100))
    u = torch.tensor([uniform(7, i) for i in range(n)])
    ks, ps, ms = (torch.full((n,), top_k), torch.full((n,), top_p), torch.full((n,), min_p))
    fast, decided = sample_from_candidates(scaled, ks, ps, ms, u)
    full = _sample_sorted(scaled, ks, ps, ms, u)
    # The peaked rows at least, unless top-k reaches past every tier (then the sort decides all).
    assert bool(decided.any()) == (top_k <= CANDIDATE_TIERS[-1])
    # Every decided row draws what the full sort draws (float summation order may move a draw
    # that lies within rounding of a boundary: allow one such row in 64).
    agree = (fast == full) | ~decided
    assert int((~agree).sum()) <= 1


def test_flat_rows_are_left_to_the_full_sort() -> None:
    """A nucleus wider than the last tier is not decided by the candidates."""
    vocab = CANDIDATE_TIERS[-1] * 4
    scaled = torch.zeros(2, vocab)  # uniform: 95% of the mass needs 95% of the vocabulary
    one = torch.ones(2)
    _, decided = sample_from_candidates(scaled, torch.zeros(2, dtype=torch.int64), one * 0.95, one * 0.0, one * 0.5)
    assert not bool(decided.any())


def test_top_k_beyond_the_candidates_is_not_decided_by_them() -> None:
    vocab = CANDIDATE_TIERS[-1] * 4
    scaled = _rows(4, vocab, seed=1)
    k = torch.full((4,), CANDIDATE_TIERS[-1] + 10)
    one = torch.ones(4)
    _, decided = sample_from_candidates(scaled, k, one * 0.95, one * 0.0, one * 0.5)
    peaked = scaled[0].softmax(-1).topk(8).values.sum() > 0.95
    assert not bool(decided[1:].any()) and (bool(decided[0]) or not bool(peaked))
