"""Top-k / top-p / min-p sampling from a row's most likely tokens, without sorting the vocabulary.

Sorting a [N, V] block of logits to find each row's nucleus cost ~430 ms of CPU per step at 128
rows over SmolLM2's 49k vocabulary, several times the model's forward. A chat model's
distribution is peaked: at temperature 0.8 the tokens that carry 95% of the mass are usually a
few dozen. So each row takes its K most likely tokens (`topk`, ~14 ms of CPU for K = 64 at 128
rows) and the full-vocabulary normaliser (one `logsumexp` pass, ~6 ms, computed once for every tier:
an `exp` of the row minus its top and a sum cost ~25 ms, the block's largest cost in a profile of
real chat logits); when the truncation's cut falls inside those K
candidates, the candidates alone decide the token. Rows whose cut lies beyond them try a wider K,
and the rest fall back to the full sort (`None` for those rows; the caller samples them as before).

The result is the distribution `sampler._truncate` defines (top-k first, then top-p over the
top-k-renormalised mass, then min-p), and the token is drawn by the same inverse CDF in vocabulary
order with the request's own uniform number, so a seeded request gets the same token as through
the full sort (up to float summation order at a boundary) whatever else is in the batch.
"""

from __future__ import annotations

import torch

# Candidate counts tried in turn; a row not decided by the last goes to the full sort.
CANDIDATE_TIERS = (64, 1024)


def sample_from_candidates(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                           u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled [n, V] (temperature applied), top_k [n] int (0 = off), top_p/min_p [n], u [n] uniforms
    -> (token ids [n] int64, decided [n] bool); rows not decided need the full sort."""
    n, vocab = scaled.shape
    tokens = torch.zeros(n, dtype=torch.int64, device=scaled.device)
    decided = torch.zeros(n, dtype=torch.bool, device=scaled.device)
    k_eff = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # [n]
    # log of each row's normaliser over the whole vocabulary, for rows whose top-k reaches past the
    # candidates (no top-k: every row); one pass, shared by the tiers.
    log_norm = (torch.logsumexp(scaled, dim=-1) if bool((k_eff > min(CANDIDATE_TIERS[0], vocab)).any())
                else torch.zeros(n, device=scaled.device))  # [n]
    todo = torch.arange(n, device=scaled.device)
    for tier in CANDIDATE_TIERS:
        if todo.numel() == 0:
            break
        size = min(tier, vocab)
        rows = scaled if todo.numel() == n else scaled[todo]  # no copy while every row is left
        vals, ids = rows.topk(size, dim=-1)  # [m, K], descending
        picked, ok = _pick(vals, ids, vocab, log_norm[todo], k_eff[todo], top_p[todo], min_p[todo], u[todo])
        tokens[todo[ok]] = picked[ok]
        decided[todo[ok]] = True
        todo = todo[~ok]
        if size == vocab:
            break
    return tokens, decided


def _pick(vals: torch.Tensor, ids: torch.Tensor, vocab: int, log_norm: torch.Tensor, k_eff: torch.Tensor,
          top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vals/ids [m, K] the top K of each row, descending; log_norm [m] the log of each row's
    normaliser over the whole vocabulary -> (token [m], decided [m])."""
    size = vals.shape[1]
    ranks = torch.arange(size, device=vals.device)[None, :]
    in_k = ranks < k_eff[:, None]  # [m, K]
    # Normaliser: over the top-k tokens when they all lie among the candidates, else over the whole
    # vocabulary (right without top-k; a row with K < k < V is not decided here). Both relative to
    # the row's top logit, whose weight is 1.
    top = vals[:, :1]
    full = torch.exp(log_norm - top[:, 0])  # [m]
    weights = torch.exp(vals - top).masked_fill(~in_k, 0.0)  # [m, K]
    norm = torch.where(k_eff <= size, weights.sum(dim=-1), full)
    probs = weights / norm[:, None]
    mass_before = probs.cumsum(dim=-1) - probs
    remove = ~in_k | (mass_before >= top_p[:, None]) | (probs < min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    # Decided when the cut lies inside the candidates: top-k within them, or the last candidate
    # already removed by top-p or min-p (both remove every token after one they remove).
    decided = (k_eff <= size) | ((k_eff >= vocab) & remove[:, -1])
    kept = weights.masked_fill(remove, 0.0)
    # Inverse CDF in vocabulary order, as the full sort's path draws.
    order = ids.argsort(dim=-1)
    kept_by_id = kept.gather(1, order)
    cdf = kept_by_id.cumsum(dim=-1)
    at = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=size - 1)
    # Rounding can land past the last kept token: take the most likely one instead.
    zero = kept_by_id.gather(1, at[:, None])[:, 0] <= 0
    token = torch.where(zero, ids[:, 0], ids.gather(1, order.gather(1, at[:, None]))[:, 0])
    return token, decided
