"""Applying grammar token masks to logits, for the constrained rows of a step only.

A mask is llguidance's bitmask: int32 words [rows, ceil(V / 32)], bit j of word w allowing token
32 * w + j. Writing -inf through a dense [rows, V] boolean costs ~0.35 ms per row of a 49k vocab
on a CPU (masked writes at random positions mispredict), more than the rest of a row's sampling.
But a grammar's mask is nearly always lopsided: inside a JSON structure a handful of tokens are
allowed (1..50 of 49k), inside a string nearly all are. So each row is handled by its minority:
- mostly blocked (more all-zero words than all-one words): the row becomes -inf except its
  allowed tokens, whose logits are copied over;
- mostly allowed: -inf is written at its blocked tokens only.
Only the words that are not uniform are expanded to bits: the work is O(rows * words + minority).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence

import numpy as np
import torch

from sluice.grammar.compiler import Matcher

_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits: [N, V] float, contiguous, modified in place; bitmask: [N, ceil(V / 32)] int32 (one row
    per logits row). Blocked tokens get -inf; allowed ones keep their logit exactly."""
    n, vocab = logits.shape
    words = bitmask.to(logits.device)
    if words.shape != (n, (vocab + 31) // 32) or not logits.is_contiguous():
        raise ValueError(f"bitmask shape {tuple(words.shape)} does not fit logits {tuple(logits.shape)}")
    mostly_blocked = (words == 0).sum(dim=1) > (words == -1).sum(dim=1)  # [N]
    blocked_rows = mostly_blocked.nonzero(as_tuple=True)[0]
    if len(blocked_rows):
        # The few allowed tokens: expand only the words that have an allowed bit.
        rows, cols = (words[blocked_rows] != 0).nonzero(as_tuple=True)  # [k]
        bits = (words[blocked_rows[rows], cols][:, None] >> _BITS.to(words.device)) & 1  # [k, 32]
        k_idx, bit = bits.nonzero(as_tuple=True)
        tokens = cols[k_idx] * 32 + bit
        in_vocab = tokens < vocab
        flat_index = blocked_rows[rows[k_idx]][in_vocab] * vocab + tokens[in_vocab]  # into logits.view(-1)
        flat = logits.view(-1)
        kept = flat[flat_index]
        logits.index_fill_(0, blocked_rows, float("-inf"))
        flat[flat_index] = kept
    open_rows = (~mostly_blocked).nonzero(as_tuple=True)[0]
    if len(open_rows):
        # Mostly allowed: a dense masked fill, whose writes are rare (and predicted).
        bits = torch.from_numpy(np.unpackbits(words[open_rows].cpu().numpy().view(np.uint8), axis=1,
                                              bitorder="little")[:, :vocab].view(np.bool_))
        sub = logits[open_rows]
        sub.masked_fill_(bits.to(logits.device).logical_not_(), float("-inf"))
        logits[open_rows] = sub


class MaskFiller:
    """Fills the bitmask of a step's constrained rows from their requests' matchers.

    A row's mask depends only on the tokens its request has already accepted (and, for a draft row,
    the drafts before it), all known when the step is scheduled: `start()` computes the masks in a
    background thread while the model runs (llguidance drops the GIL), `result()` waits for them.
    """

    def __init__(self, vocab_size: int) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.fill_s = 0.0  # seconds spent filling masks (beside the forward pass), for benchmarks

    def start(self, rows: Sequence[tuple[int, Matcher, Sequence[int]]]) -> concurrent.futures.Future[torch.Tensor]:
        """rows: (logits row, matcher, drafts before that row); a request's rows in draft order."""
        return self._pool.submit(self.fill, rows)

    def fill(self, rows: Sequence[tuple[int, Matcher, Sequence[int]]]) -> torch.Tensor:
        """-> bitmask [len(rows), words] int32, row i for rows[i]."""
        start = time.perf_counter()
        try:
            return self._fill(rows)
        finally:
            self.fill_s += time.perf_counter() - start

    def _fill(self, rows: Sequence[tuple[int, Matcher, Sequence[int]]]) -> torch.Tensor:
        bitmask = torch.empty(len(rows), self._words, dtype=torch.int32)
        row_bytes = self._words * 4
        base = [(m.ll, i) for i, (_, m, drafts) in enumerate(rows) if not drafts]
        if base:  # every matcher at its own state: one parallel call
            self._executor.unsafe_compute_mask_ptr(base, bitmask.data_ptr(), row_bytes, len(rows))
        for i, (_, matcher, drafts) in enumerate(rows):
            if drafts:  # a draft row: the mask after its request's drafts so far, then back
                matcher.consume(drafts)
                matcher.ll.unsafe_compute_mask_ptr(bitmask.data_ptr() + i * row_bytes, row_bytes)
                matcher.rollback(len(drafts))
        return bitmask

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
