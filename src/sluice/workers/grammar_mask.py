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
On the CPU (float32 logits) `apply_bitmask_to_rows` hands the whole step to one native call
instead (kernels/cpu_grammar_mask.py), once that kernel is built; this torch path is its fallback
and its reference.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from sluice.grammar.compiler import Matcher
from sluice.kernels import cpu_grammar_mask

_BITS = torch.arange(32, dtype=torch.int32)


def _check(logits: torch.Tensor, num_rows: int, bitmask: torch.Tensor) -> None:
    if bitmask.shape != (num_rows, (logits.shape[1] + 31) // 32) or not logits.is_contiguous():
        raise ValueError(f"bitmask shape {tuple(bitmask.shape)} does not fit {num_rows} rows of logits "
                         f"{tuple(logits.shape)}")


def apply_bitmask_to_rows(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """logits: [N, V] float, contiguous, modified in place: bitmask row j ([len(rows), ceil(V / 32)]
    int32) masks logits row rows[j]; the other rows are not touched."""
    _check(logits, len(rows), bitmask)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_grammar_mask.KERNEL.ready():
        cpu_grammar_mask.apply_token_bitmask(logits, torch.tensor(rows, dtype=torch.int64), bitmask.contiguous())
    elif list(rows) == list(range(logits.shape[0])):  # every row, in order
        apply_bitmask(logits, bitmask)
    else:
        index = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, index)
        apply_bitmask(sub, bitmask)
        logits.index_copy_(0, index, sub)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits: [N, V] float, contiguous, modified in place; bitmask: [N, ceil(V / 32)] int32 (one row
    per logits row). Blocked tokens get -inf; allowed ones keep their logit exactly. Torch ops only."""
    _check(logits, logits.shape[0], bitmask)
    vocab = logits.shape[1]
    words = bitmask.to(logits.device)
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
    """Fills the bitmask of a step's constrained rows from their requests' matchers, in one call.

    A row's mask depends only on the tokens its request has already accepted (and, for a draft row,
    the drafts before it), all known when the step is scheduled. llguidance computes every row of
    the step, draft rows included (it advances past each draft and rolls back), in one call that
    drops the GIL. With `overlap`, `start()` runs that call in a background thread while the model
    runs and `result()` waits for it; without, the fill runs when its result is asked for. Overlap
    pays only where a core is free of torch's intra-op threads (the runner decides): otherwise the
    fill thread takes a core from an OpenMP region of the forward pass, whose other threads then
    wait for it at the region's end.
    """

    def __init__(self, vocab_size: int, overlap: bool) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self.overlap = overlap
        self._words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.fill_s = 0.0  # seconds spent filling masks (beside the forward pass with overlap), for benchmarks

    def start(self, requests: Sequence[tuple[Matcher, Sequence[int]]]) -> Callable[[], torch.Tensor]:
        """requests: (matcher, drafts) of each constrained request of the step, in row order; each
        has 1 + len(drafts) mask rows: its next token's, then one after each draft. Returns the
        function that gives the bitmask (waiting for the thread, or filling then)."""
        if self.overlap:
            return self._pool.submit(self.fill, requests).result
        return functools.partial(self.fill, requests)

    def fill(self, requests: Sequence[tuple[Matcher, Sequence[int]]]) -> torch.Tensor:
        """-> bitmask [sum(1 + len(drafts)), words] int32, the rows of `start`."""
        start = time.perf_counter()
        try:
            plain, drafted, row = [], [], 0  # llguidance takes requests without drafts apart
            for matcher, drafts in requests:
                if drafts:
                    drafted.append((matcher.ll, row, list(drafts)))
                else:
                    plain.append((matcher.ll, row))
                row += 1 + len(drafts)
            # Drafts were cut to what the grammar accepts (scheduler), so llguidance writes every
            # row; it stops early only after a draft that ends the grammar (EOS), and a row after
            # that is never kept (the request stops there): all-allowed, not garbage.
            bitmask = torch.full((row, self._words), -1, dtype=torch.int32)
            if plain:
                self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), self._words * 4, row)
            if drafted:
                self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), self._words * 4,
                                                                        row)
            return bitmask
        finally:
            self.fill_s += time.perf_counter() - start

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
