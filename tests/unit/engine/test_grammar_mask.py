"""The sparse bitmask apply equals a dense reference, and the sampler applies logit_bias and the
grammar mask to the constrained rows only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.protocol import SamplingParams
from sluice.workers.grammar_mask import apply_bitmask
from sluice.workers.sampler import SampleRow, sample

pytestmark = pytest.mark.unit


def _dense(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return logits.masked_fill(torch.from_numpy(bits == 0), float("-inf"))


def _mask(rows: int, vocab: int, allowed: list[list[int]]) -> torch.Tensor:
    bits = np.zeros((rows, ((vocab + 31) // 32) * 32), dtype=np.uint8)
    for r, ids in enumerate(allowed):
        bits[r, ids] = 1
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 49152])
def test_sparse_apply_equals_dense(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    masks = [
        torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=gen),  # mixed
        torch.full((2, words), -1, dtype=torch.int32),  # everything allowed
        _mask(2, vocab, [[0], [vocab - 1]]),  # one token allowed (mostly blocked rows)
        _mask(1, vocab, [[i for i in range(vocab) if i % 97]]),  # mostly allowed
    ]
    for bitmask in masks:
        logits = torch.randn(bitmask.shape[0], vocab, generator=gen)
        expected = _dense(logits, bitmask)
        apply_bitmask(logits, bitmask)
        assert torch.equal(logits, expected)


def test_apply_refuses_a_mismatched_mask() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        apply_bitmask(torch.zeros(2, 64), torch.zeros(2, 3, dtype=torch.int32))


def _row(**params) -> SampleRow:
    return SampleRow(SamplingParams(**params), [1, 2], [], 5)


def test_mask_and_bias_touch_only_their_rows() -> None:
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    plain = sample(logits, [_row(temperature=0.0)] * 3).token_ids
    rows = [_row(temperature=0.0), _row(temperature=0.0, logit_bias=((7, 100.0),)), _row(temperature=0.0)]
    # Row 2 is constrained to token 11 alone; row 0 is untouched; row 1 is biased to token 7.
    out = sample(logits, rows, [2], _mask(1, vocab, [[11]]))
    assert out.token_ids == [plain[0], 7, 11]
    # A constrained sampled row with logprobs: only allowed tokens are reported, renormalised.
    rows = [_row(temperature=1.0, logprobs=True, top_logprobs=3)]
    out = sample(logits[:1], rows, [0], _mask(1, vocab, [[3, 9]]))
    assert out.token_ids[0] in (3, 9)
    top = out.logprobs[0].top
    assert {t.token_id for t in top[:2]} == {3, 9} and top[2].logprob == float("-inf")
    assert sum(float(np.exp(t.logprob)) for t in top[:2]) == pytest.approx(1.0, abs=1e-5)
