"""Turns the logits of the rows that sample into tokens (and optional logprobs).

Order of processing, vectorised over rows [N, V]:
  0. logit_bias (OpenAI's: added to the raw logits of the listed tokens), then the grammar mask of
     the constrained rows (workers/grammar_mask.py: blocked tokens -inf; unconstrained rows are not
     touched, and a step without constrained rows or biases skips this entirely);
  1. penalties: repetition (HF: over prompt + output; positive logits divided, negative
     multiplied), then presence/frequency (OpenAI: over output only,
     logit -= presence * [count > 0] + frequency * count);
  2. greedy rows (temperature 0 or top_k 1): argmax of the penalised logits, which is exactly
     argmax of the raw logits when no penalty is set;
  3. other rows: divide by temperature, then top-k, top-p and min-p truncate the distribution,
     and one token is drawn by inverse CDF with a uniform number that is a function of the
     request's seed and the output position alone (a counter-based hash, no generator state), so
     a seeded request gets the same tokens whatever else is in the batch, however often it was
     preempted, and when it is resumed at position k on another worker (worker failover).
Logprobs (when asked) are the log-softmax of the logits after logit_bias, the grammar mask,
penalties and temperature (temperature 1 for greedy rows) but before top-k/top-p/min-p truncation,
so top_logprobs never report -inf for tokens that truncation removed. For a constrained row they
describe the distribution the token was drawn from: the grammar's allowed tokens renormalised
(vLLM v1 likewise applies the grammar bitmask to the logits before its sampler computes logprobs),
so every reported top_logprob is a token the grammar allowed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import torch

from sluice.protocol import PositionLogprobs, SamplingParams, TokenLogprob
from sluice.workers.candidates import sample_from_candidates
from sluice.workers.grammar_mask import apply_bitmask_to_rows


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One request that samples a token this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # its length is the position of the token sampled now
    seed: int | None  # the request's seed (the runner draws one for an unseeded request); required unless greedy


class Continued(Sequence[int]):
    """`base` followed by `extra`, without copying `base`: a draft row's output so far (the
    request's output, then the drafts before that row)."""

    __slots__ = ("_base", "_extra")

    def __init__(self, base: Sequence[int], extra: Sequence[int]) -> None:
        self._base, self._extra = base, extra

    def __len__(self) -> int:
        return len(self._base) + len(self._extra)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [*self][index]
        size = len(self)
        position = index + size if index < 0 else index
        if not 0 <= position < size:
            raise IndexError("Continued index out of range")
        split = len(self._base)
        return self._base[position] if position < split else self._extra[position - split]

    def __iter__(self) -> Iterator[int]:
        yield from self._base
        yield from self._extra


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # None where the request did not ask for logprobs


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that output position `position` of a request seeded `seed`
    samples with: stateless, so any worker computes the same one (53 random bits)."""
    z = _mix64((_mix64(seed & _MASK64) + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64)
    return (z >> 11) * (1.0 / (1 << 53))


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [N, L] int64 padded with 0 and a float mask [N, L] (1 = real token)."""
    width = max(1, max((len(r) for r in rows), default=0))
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
            mask[i, : len(r)] = 1.0
    return ids.to(device), mask.to(device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """logits: [N, V] float32 -> penalised copy (rows without penalties unchanged)."""
    device = logits.device
    vocab = logits.shape[1]
    idx = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    if not idx:
        return logits  # unchanged: no copy (the caller never writes into it)
    logits = logits.clone()
    sub = logits[idx]  # [n, V]
    n = len(idx)
    rep = torch.tensor([rows[i].params.repetition_penalty for i in idx], device=device)[:, None]
    if bool((rep != 1.0).any()):
        seen_ids = [[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in idx]
        ids, mask = _pad(seen_ids, device)
        seen = torch.zeros(n, vocab, device=device).scatter_add_(1, ids, mask) > 0
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
    presence = torch.tensor([rows[i].params.presence_penalty for i in idx], device=device)[:, None]
    frequency = torch.tensor([rows[i].params.frequency_penalty for i in idx], device=device)[:, None]
    if bool((presence != 0).any() or (frequency != 0).any()):
        ids, mask = _pad([rows[i].output_token_ids for i in idx], device)
        counts = torch.zeros(n, vocab, device=device).scatter_add_(1, ids, mask)  # [n, V]
        sub = sub - presence * (counts > 0).float() - frequency * counts
    logits[idx] = sub
    return logits


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> torch.Tensor:
    """logits [n, V] (already temperature-scaled); top_k [n] int (0 = off), top_p/min_p [n] -> masked."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))[:, None]
    remove = ranks >= k
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # top-p: drop a token once the mass strictly before it already reaches top_p (keeps >= 1).
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p[:, None]
    # min-p: drop tokens below min_p times the most likely token's probability.
    remove |= probs < min_p[:, None] * probs[:, :1]
    remove[:, 0] = False
    masked_sorted = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked_sorted)


def _sample_sorted(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   u: torch.Tensor) -> torch.Tensor:
    """scaled [n, V], u [n] -> one token per row: truncate over the fully sorted row, then draw by
    inverse CDF in vocabulary order."""
    probs = _truncate(scaled, top_k, top_p, min_p).softmax(dim=-1)  # [n, V]
    cdf = probs.cumsum(dim=-1)
    # Inverse CDF: the first token whose cumulative mass exceeds u * total (clamped in range).
    picked = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0]
    picked = picked.clamp(max=probs.shape[1] - 1)
    # Guard against landing on a zero-probability token at the tail after rounding.
    zero = probs.gather(1, picked[:, None])[:, 0] <= 0
    if bool(zero.any()):
        picked = torch.where(zero, probs.argmax(dim=-1), picked)
    return picked


def _logprobs(logprobs: torch.Tensor, chosen: list[int], rows: Sequence[SampleRow],
              ) -> list[PositionLogprobs | None]:
    out: list[PositionLogprobs | None] = []
    max_top = max((r.params.top_logprobs for r in rows if r.params.logprobs), default=0)
    top_vals: list[list[float]] | None = None
    top_ids: list[list[int]] | None = None
    if max_top:
        values, indices = logprobs.topk(max_top, dim=-1)
        top_vals, top_ids = values.tolist(), indices.tolist()
    chosen_lp = logprobs.gather(1, torch.tensor(chosen, device=logprobs.device)[:, None])[:, 0].tolist()
    for i, r in enumerate(rows):
        if not r.params.logprobs:
            out.append(None)
            continue
        top: tuple[TokenLogprob, ...] = ()
        if r.params.top_logprobs and top_ids is not None and top_vals is not None:
            top = tuple(TokenLogprob(int(t), float(v))
                        for t, v in zip(top_ids[i][: r.params.top_logprobs],
                                        top_vals[i][: r.params.top_logprobs], strict=True))
        out.append(PositionLogprobs(chosen=TokenLogprob(chosen[i], float(chosen_lp[i])), top=top))
    return out


def apply_bias_and_mask(logits: torch.Tensor, rows: Sequence[SampleRow], mask_rows: Sequence[int] = (),
                        bitmask: torch.Tensor | None = None, *, in_place: bool = False) -> torch.Tensor:
    """logit_bias, then the grammar masks (bitmask row j for logits row mask_rows[j]); returns
    `logits` itself when neither applies, else a modified copy (or `logits` modified, `in_place`:
    a caller that owns them saves the copy of [N, V])."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased and not mask_rows:
        return logits
    if not in_place:
        logits = logits.clone()
    for i in biased:
        ids, biases = zip(*rows[i].params.logit_bias, strict=True)
        index = torch.tensor(ids, device=logits.device)
        logits[i].index_add_(0, index, torch.tensor(biases, device=logits.device, dtype=logits.dtype))
    if mask_rows:
        if bitmask is None or bitmask.shape[0] != len(mask_rows):
            raise ValueError(f"{len(mask_rows)} constrained rows need as many bitmask rows")
        apply_bitmask_to_rows(logits, mask_rows, bitmask)
    return logits


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], mask_rows: Sequence[int] = (),
           bitmask: torch.Tensor | None = None) -> SamplerOutput:
    """logits: [N, V] float32, row i belonging to rows[i]; `mask_rows` (ascending) are the rows
    under a grammar, `bitmask` their masks [len(mask_rows), ceil(V / 32)] int32."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"got {logits.shape[0]} logit rows for {len(rows)} requests")
    logits = apply_bias_and_mask(logits, rows, mask_rows, bitmask)
    device = logits.device
    want_logprobs = any(r.params.logprobs for r in rows)
    if not want_logprobs and all(r.params.greedy and not _has_penalty(r.params) for r in rows):
        return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))

    logits = apply_penalties(logits, rows)
    greedy = [r.params.greedy for r in rows]
    # Greedy rows keep temperature 1 so their logprobs are those of the penalised logits.
    temps = torch.tensor([1.0 if g else r.params.temperature for g, r in zip(greedy, rows, strict=True)],
                         device=device)[:, None]
    scaled = logits / temps
    chosen = torch.zeros(len(rows), dtype=torch.int64, device=device)  # [N]
    greedy_idx = [i for i, g in enumerate(greedy) if g]
    if greedy_idx:
        chosen[greedy_idx] = scaled[greedy_idx].argmax(dim=-1)
    random_idx = [i for i, g in enumerate(greedy) if not g]
    if random_idx:
        sub_rows = [rows[i] for i in random_idx]
        uniforms = []
        for r in sub_rows:
            if r.seed is None:
                raise ValueError("a sampling (non-greedy) request needs a seed")
            uniforms.append(uniform(r.seed, len(r.output_token_ids)))
        sub = scaled if len(random_idx) == len(rows) else scaled[random_idx]  # all sampled: no copy
        top_k = torch.tensor([r.params.top_k for r in sub_rows], device=device)
        top_p = torch.tensor([r.params.top_p for r in sub_rows], device=device)
        min_p = torch.tensor([r.params.min_p for r in sub_rows], device=device)
        u = torch.tensor(uniforms, device=device, dtype=sub.dtype)
        # Most rows are decided by their most likely tokens alone (workers/candidates.py); the
        # rest take the full sort.
        picked, decided = sample_from_candidates(sub, top_k, top_p, min_p, u)
        if not bool(decided.all()):
            rest = (~decided).nonzero()[:, 0]
            picked[rest] = _sample_sorted(sub[rest], top_k[rest], top_p[rest], min_p[rest], u[rest])
        if len(random_idx) == len(rows):
            chosen = picked
        else:
            chosen[random_idx] = picked
    token_ids = chosen.tolist()
    logprob_rows: list[PositionLogprobs | None] = [None] * len(rows)
    if want_logprobs:
        logprob_rows = _logprobs(scaled.log_softmax(dim=-1), token_ids, rows)
    return SamplerOutput(token_ids, logprob_rows)
