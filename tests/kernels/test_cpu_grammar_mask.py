"""The native grammar-mask apply (kernels/cpu_grammar_mask.py) against the torch path and a dense
reference, and `apply_bitmask_to_rows`'s hand-over to it.

The `built` fixture (conftest.py) builds the kernel with warnings as errors; the tests skip
where no compiler is available.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.kernels import cpu_grammar_mask
from sluice.workers.grammar_mask import apply_bitmask, apply_bitmask_to_rows

pytestmark = [pytest.mark.kernels, pytest.mark.timeout(1800)]

NATIVE_KERNEL = cpu_grammar_mask.KERNEL  # built by the `built` fixture (conftest.py)


def _dense(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Every token's bit unpacked, -inf where it is clear (numpy, independent of both paths)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[1]]
    return logits.masked_fill(torch.from_numpy(bits == 0), float("-inf"))


def _masks(rows: int, vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    words = (vocab + 31) // 32
    one_allowed = torch.zeros(rows, words, dtype=torch.int32)
    one_allowed[:, 0] = 1 << 3  # token 3 alone (where the vocab has it)
    mostly_allowed = torch.full((rows, words), -1, dtype=torch.int32)
    mostly_allowed[:, words // 2] = 0x7FFF0000  # a mixed word in the middle
    return [
        torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen),  # every word mixed
        torch.full((rows, words), -1, dtype=torch.int32),  # everything allowed
        torch.zeros(rows, words, dtype=torch.int32),  # nothing allowed
        one_allowed,
        mostly_allowed,
    ]


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 49152])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_kernel_equals_torch_path_and_dense(built: None, threads: int, vocab: int, rows: int) -> None:
    """Every mask kind, all rows masked, bit for bit: allowed logits untouched, the rest -inf."""
    gen = torch.Generator().manual_seed(vocab * 100 + rows)
    for bitmask in _masks(rows, vocab, gen):
        logits = torch.randn(rows, vocab, generator=gen)
        expected = _dense(logits, bitmask)
        torch_path = logits.clone()
        apply_bitmask(torch_path, bitmask)
        cpu_grammar_mask.apply_token_bitmask(logits, torch.arange(rows), bitmask)
        assert torch.equal(logits, expected) and torch.equal(torch_path, expected)


def test_kernel_masks_only_the_rows_it_is_given(built: None, threads: int) -> None:
    """Rows 1, 4 and 6 of 8 masked, in that order; the others keep every logit."""
    vocab, rows = 1000, [1, 4, 6]
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(8, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    expected = logits.clone()
    expected[rows] = _dense(logits[rows], bitmask)
    cpu_grammar_mask.apply_token_bitmask(logits, torch.tensor(rows), bitmask)
    assert torch.equal(logits, expected)


def test_kernel_refuses_bad_shapes_and_rows(built: None) -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_grammar_mask.apply_token_bitmask(logits, torch.arange(2), torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_grammar_mask.apply_token_bitmask(logits, torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int32))


@pytest.mark.parametrize("switch", ["1", "0"], ids=["kernel", "torch-path"])
def test_rows_apply_is_the_same_either_way(built: None, monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    """`apply_bitmask_to_rows` (what the sampler calls) gives the same logits with the kernel on or off,
    and refuses a mask that does not fit before either path runs."""
    monkeypatch.setenv(cpu_grammar_mask.KERNEL.switch, switch)
    vocab, rows = 49152, [0, 2, 3]
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = _masks(len(rows), vocab, gen)[0]
    expected = logits.clone()
    expected[rows] = _dense(logits[rows], bitmask)
    apply_bitmask_to_rows(logits, rows, bitmask)
    assert torch.equal(logits, expected)
    with pytest.raises(ValueError, match="does not fit"):
        apply_bitmask_to_rows(logits, rows, bitmask[:2])
