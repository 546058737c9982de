"""Paged attention over a block-structured KV cache: metadata and the torch reference.

Layout shared by every backend:
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  a token's cache slot = block_id * block_size + offset_in_block
A batch is a flat list of query tokens (prefill chunks and decodes mixed). Sequence b owns
query rows query_start_loc[b]:query_start_loc[b+1]; its context (cached prefix plus the new
tokens, already written to the cache) has seq_lens[b] tokens, so its i-th query token sits at
position seq_lens[b] - q_len_b + i and attends causally to positions 0..that position.

Two torch implementations live here: `paged_attention_ref`, a per-sequence loop that is the
ground truth every other implementation is tested against, and `paged_attention_torch`, the
batched CPU hot path (padded gather + one fused masked attention call per group of sequences;
decodes through the native kernel of `cpu_decode.py` and prefill chunks through that of
`cpu_prefill.py` once they are built) that `Ops("torch")` uses.
The Triton kernels live in `paged_decode.py` and `paged_prefill.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sluice.kernels import cpu_decode, cpu_prefill


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host-side copies so the torch path never synchronises with the device.
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # Per-step scratch: `paged_attention_torch` keeps its gather plan here, so the other layers of
    # the step reuse what the first one built (the metadata of a step is never mutated).
    plan_cache: dict[tuple[object, ...], _StepPlan] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Torch reference: gather each sequence's K/V from its blocks and run causal attention."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc_host
    for b, seq_len in enumerate(meta.seq_lens_host):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[b, :num_blocks].long()
        # k, v: [seq_len, Hkv, D] gathered from the paged cache
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qb = q[q_start:q_end].transpose(0, 1).float()  # [Hq, q_len, D]
        scores = torch.matmul(qb, k.transpose(0, 1).transpose(1, 2).float()) * scale  # [Hq, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        causal = k_pos[None, :] > q_pos[:, None]
        scores.masked_fill_(causal[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, v.transpose(0, 1).float()).transpose(0, 1).to(q.dtype)
    return out


# Upper bound on the float32 elements one padded group may materialise (scores or mask, plus
# gathered K and V): 2**25 elements = 128 MiB. Larger batches are split into several groups, and
# a chunk too large on its own is split by query rows.
_GROUP_ELEMENT_BUDGET = 1 << 25


class _Piece(NamedTuple):
    """Query rows token_start .. token_start + num_rows of sequence `seq`; the last row sits at
    position context_len - 1 (so it sees keys 0 .. context_len - 1, earlier rows fewer)."""

    seq: int
    token_start: int
    num_rows: int
    context_len: int


class _NativeDecodes(NamedTuple):
    """The decodes and short chunks of a mixed batch, for the native CPU kernel (kernels/cpu_decode.py)."""

    token_index: torch.Tensor  # [N] int64: their query rows, each sequence's consecutive
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: context length including the query rows
    query_start_loc: torch.Tensor | None  # [S + 1] int32 rows per sequence (None: one each)


class _GroupPlan(NamedTuple):
    """The layer-independent part of one group's attention: built once per step."""

    num_pieces: int  # G
    rows_per_piece: int  # R: query rows per piece, padded to the group's longest
    blocks: torch.Tensor  # [G * num_blocks] int64: the pieces' block tables, flattened
    # [G * R] int64 token row of each (piece, row), padded rows repeat a real one; None when the
    # group is G consecutive decode tokens starting at `first_token`.
    token_index: torch.Tensor | None
    first_token: int
    # float32 additive mask, 0 where a key is visible and -inf where not: [G, 1, 1, L] for decodes,
    # [G, 1, R * group, L] for chunks, broadcast over the KV heads by the attention call.
    mask: torch.Tensor
    # Rows of the [G * R] result that are real (None: all of them); they go to those token rows.
    real_rows: torch.Tensor | None


class _StepPlan(NamedTuple):
    groups: list[_GroupPlan]  # what the torch path attends, group by group
    native: _NativeDecodes | None  # decodes the native kernel attends (None: none, or no kernel)
    # [P, 4] int64 (sequence, first token row, rows, context length): the chunks the native
    # prefill kernel attends (None: none, or no kernel).
    prefill: torch.Tensor | None = None
    # Every sequence a decode or a short chunk: the whole batch through the decode kernel.
    all_native_decodes: bool = False


def _native_kernels(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[bool, bool]:
    """Whether the native decode and prefill kernels apply (float32 on the CPU, built, not
    switched off): asked once per step, when its plan is built, so every layer of a step takes
    the same path and `ready()` is not asked per layer."""
    if not (q.is_cpu and q.dtype == torch.float32 and k_cache.dtype == torch.float32):
        return False, False
    return cpu_decode.KERNEL.ready(), cpu_prefill.KERNEL.ready()


def paged_attention_torch(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Batched torch implementation with the same semantics as `paged_attention_ref`.

    Sequences are split into decodes (one query token) and chunks (several), and each kind is
    cut into groups that fit `_GROUP_ELEMENT_BUDGET`. Each group gathers its K/V blocks into a
    padded [G, L, Hkv, D] tensor and runs one fused `scaled_dot_product_attention` with an
    additive mask; the query heads that share a KV head are stacked as extra query rows, so K/V
    are never repeated. The plan (grouping, block indices, masks) depends only on the metadata:
    the first layer of a step builds it and the others reuse it. Float32 on the CPU, the native
    kernels take over once built, gather-free: the decodes go to `cpu_decode` (all of a
    decode-only batch, the decode rows of a mixed one) and the chunks to `cpu_prefill` (causal,
    masked upper triangle skipped); whatever they do not take still runs in the groups.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    key = (num_q_heads, num_kv_heads, head_dim, block_size, q.device, q.dtype, k_cache.dtype)
    plan = meta.plan_cache.get(key)
    if plan is None:
        native_decodes, native_prefill = _native_kernels(q, k_cache)
        plan = _build_plan(meta, num_q_heads, num_kv_heads, head_dim, block_size, q.device, native_decodes,
                           native_prefill)
        meta.plan_cache[key] = plan
    if plan.all_native_decodes:
        # Gather-free: the native kernel reads each sequence's K/V blocks where they lie (faster
        # than the padded gather + SDPA at every batch size measured, 1-128 sequences).
        starts = None if meta.is_decode_only else meta.query_start_loc
        return cpu_decode.paged_decode_cpu(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, starts)
    num_tokens = q.shape[0]
    groups = plan.groups
    if plan.native is None and plan.prefill is None and len(groups) == 1 and groups[0].token_index is None \
            and groups[0].num_pieces == num_tokens:
        # A decode-only batch in one group (the common step): the result rows are the output.
        return _attend_group(q, k_cache, v_cache, groups[0], scale).to(q.dtype)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if plan.native is not None:  # a mixed batch's decodes: the kernel, the chunks below
        rows = plan.native.token_index
        attn = cpu_decode.paged_decode_cpu(q.index_select(0, rows), k_cache, v_cache, plan.native.block_tables,
                                           plan.native.seq_lens, scale, plan.native.query_start_loc)
        out.index_copy_(0, rows, attn)
    if plan.prefill is not None:  # the chunks: written into their rows of `out` in place
        cpu_prefill.paged_prefill_cpu(q, k_cache, v_cache, meta.block_tables, plan.prefill, scale, out)
    for group in groups:
        attn = _attend_group(q, k_cache, v_cache, group, scale)  # [G * R, Hq, D]
        if group.token_index is None:
            out[group.first_token:group.first_token + group.num_pieces] = attn
            continue
        dst = group.token_index
        if group.real_rows is not None:
            attn, dst = attn.index_select(0, group.real_rows), dst.index_select(0, group.real_rows)
        out.index_copy_(0, dst, attn.to(out.dtype))
    return out


def _build_plan(
    meta: AttentionMetadata,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device,
    native_decodes: bool,
    native_prefill: bool = False,
) -> _StepPlan:
    starts = meta.query_start_loc_host
    # With the native decode kernel, a short chunk (a decode and its speculative drafts) goes to it
    # too: its rows share one read of the sequence's K/V, each over the context up to its position.
    as_decodes = _SHORT_CHUNK_ROWS if native_decodes else 1
    if native_decodes and meta.max_query_len <= as_decodes:
        return _StepPlan([], None, None, all_native_decodes=True)
    prefill = None
    if native_prefill:
        # One piece per chunk, whole: the kernel needs no element budget (it never pads).
        spec = [(b, starts[b], starts[b + 1] - starts[b], meta.seq_lens_host[b]) for b in range(meta.num_seqs)
                if starts[b + 1] - starts[b] > as_decodes]
        if spec:
            prefill = torch.tensor(spec, dtype=torch.int64)
    decodes: list[_Piece] = []
    chunks: list[_Piece] = []
    native_seqs: list[int] = []
    for b in range(meta.num_seqs):
        q_len, seq_len = starts[b + 1] - starts[b], meta.seq_lens_host[b]
        if q_len == 0:
            continue  # no query rows this step: nothing to attend
        if q_len <= as_decodes:
            if native_decodes:
                native_seqs.append(b)
            else:
                decodes.append(_Piece(b, starts[b], 1, seq_len))
            continue
        if prefill is not None:
            continue  # the native prefill kernel's
        # Rows per piece so that one piece alone fits the budget (at least one row).
        kv_cost = 2 * seq_len * num_kv_heads * head_dim
        rows = max(1, (_GROUP_ELEMENT_BUDGET - kv_cost) // max(num_q_heads * seq_len, 1))
        for first in range(0, q_len, rows):
            n = min(rows, q_len - first)
            chunks.append(_Piece(b, starts[b] + first, n, seq_len - q_len + first + n))
    native = None
    if native_seqs:
        num_rows = [starts[b + 1] - starts[b] for b in native_seqs]
        seqs = torch.tensor(native_seqs, device=meta.block_tables.device)
        native = _NativeDecodes(
            torch.tensor([t for b in native_seqs for t in range(starts[b], starts[b + 1])], device=device),
            meta.block_tables.index_select(0, seqs),
            torch.tensor([meta.seq_lens_host[b] for b in native_seqs], dtype=torch.int32, device=device),
            None if max(num_rows) == 1 else torch.tensor([0, *itertools.accumulate(num_rows)], dtype=torch.int32))
    plan: list[_GroupPlan] = []
    for bucket in [*_bucket_by_length(decodes, block_size, num_kv_heads * head_dim), chunks]:
        for group in _split_by_budget(bucket, num_q_heads, num_kv_heads, head_dim):
            plan.append(_plan_group(meta, group, num_q_heads // num_kv_heads, block_size, device))
    return _StepPlan(plan, native, prefill)


# Chunks of at most this many rows go to the native decode kernel row by row when it is built: a
# verification chunk (a decode and its drafts) is too short for the prefill kernel's per-chunk
# key transpose to pay. 128 sequences of 80-700 tokens, 2 threads, one layer: 5 rows 17 ms vs the
# prefill kernel's 46, 8 rows 41 vs 60, 16 rows 61 vs 67, 32 rows 95 vs 86.
_SHORT_CHUNK_ROWS = 8
# What one more group costs (its own gather, mask and attention call), in the currency of padded
# K/V elements: about what reading and writing 2**15 float32 elements costs on a CPU.
_GROUP_OVERHEAD_ELEMENTS = 1 << 15
# Distinct lengths the bucketing distinguishes; longer tails are merged into coarser buckets.
_MAX_LENGTH_CLASSES = 48


def _bucket_by_length(pieces: list[_Piece], block_size: int, kv_row_elements: int) -> list[list[_Piece]]:
    """Cut decodes into groups of similar context length, so a short context is not padded to
    the longest one in the batch.

    Pieces are sorted by length in blocks (longest first) and cut where the padding saved outweighs
    `_GROUP_OVERHEAD_ELEMENTS` per extra group: an exact dynamic programme over the distinct
    lengths, of which there are at most `_MAX_LENGTH_CLASSES` (coarser classes beyond that).
    When no cut pays, the one group keeps the pieces' token order.
    """
    if len(pieces) < 2:
        return [pieces] if pieces else []
    ordered = sorted(pieces, key=lambda p: -p.context_len)
    longest = -(-ordered[0].context_len // block_size)
    step = -(-longest // _MAX_LENGTH_CLASSES)  # blocks per length class
    classes: list[int] = []  # padded length (blocks) of each class, descending
    ends: list[int] = []  # index into `ordered` one past each class
    for i, piece in enumerate(ordered):
        padded = -(-piece.context_len // (block_size * step)) * step
        if classes and classes[-1] == padded:
            ends[-1] = i + 1
        else:
            classes.append(padded)
            ends.append(i + 1)
    slot_cost = block_size * kv_row_elements
    # best[j]: cheapest cost of the classes before j; cut[j]: where its last group starts.
    best = [0.0] + [float("inf")] * len(classes)
    cut = [0] * (len(classes) + 1)
    for j in range(1, len(classes) + 1):
        for i in range(j):
            first = ends[i - 1] if i else 0
            cost = best[i] + _GROUP_OVERHEAD_ELEMENTS + (ends[j - 1] - first) * classes[i] * slot_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    if cut[len(classes)] == 0:
        return [pieces]  # one group: keep token order, so a decode-only batch needs no reordering
    groups: list[list[_Piece]] = []
    j = len(classes)
    while j:
        i = cut[j]
        groups.append(ordered[ends[i - 1] if i else 0:ends[j - 1]])
        j = i
    return groups[::-1]


def _split_by_budget(
    pieces: Sequence[_Piece], num_q_heads: int, num_kv_heads: int, head_dim: int
) -> list[list[_Piece]]:
    """Greedy split, in order, so each group's padded tensors stay under the element budget."""
    groups: list[list[_Piece]] = []
    current: list[_Piece] = []
    max_q = max_l = 0
    for piece in pieces:
        new_q, new_l = max(max_q, piece.num_rows), max(max_l, piece.context_len)
        per_piece = new_q * num_q_heads * new_l + 2 * new_l * num_kv_heads * head_dim
        if current and per_piece * (len(current) + 1) > _GROUP_ELEMENT_BUDGET:
            groups.append(current)
            current, new_q, new_l = [], piece.num_rows, piece.context_len
        current.append(piece)
        max_q, max_l = new_q, new_l
    if current:
        groups.append(current)
    return groups


def _plan_group(
    meta: AttentionMetadata, group: list[_Piece], group_size: int, block_size: int, device: torch.device
) -> _GroupPlan:
    num_pieces = len(group)
    max_q = max(p.num_rows for p in group)
    num_blocks = (max(p.context_len for p in group) + block_size - 1) // block_size
    index = torch.tensor([p.seq for p in group], device=meta.block_tables.device)
    blocks = meta.block_tables[index, :num_blocks].to(device=device, dtype=torch.long).flatten()
    ctx_lens = torch.tensor([p.context_len for p in group], device=device)
    k_pos = torch.arange(num_blocks * block_size, device=device)
    first = group[0].token_start
    if max_q == 1:
        consecutive = all(p.token_start == first + i for i, p in enumerate(group))
        token_index = None if consecutive else torch.tensor([p.token_start for p in group], device=device)
        hidden = (k_pos[None, :] >= ctx_lens[:, None])[:, None, None, :]  # [G, 1, 1, L]
        real_rows = None
    else:
        q_lens = torch.tensor([p.num_rows for p in group], device=device)
        rows = torch.arange(max_q, device=device)
        valid = rows[None, :] < q_lens[:, None]  # [G, max_q]
        starts = torch.tensor([p.token_start for p in group], device=device)
        token_index = torch.where(valid, starts[:, None] + rows[None, :], starts[:, None]).flatten()
        real_rows = None if bool(valid.all()) else valid.flatten().nonzero().flatten()
        q_pos = (ctx_lens - q_lens)[:, None] + rows[None, :]  # [G, max_q]
        # Key j is visible to row i when j <= pos(i) and j < context_len; a padded row (i >= rows)
        # has pos >= context_len, so it still sees every real key and never yields NaN.
        visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx_lens[:, None, None])
        hidden = ~visible.repeat_interleave(group_size, dim=1)[:, None]  # [G, 1, max_q * group, L]
    mask = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))
    return _GroupPlan(num_pieces, max_q, blocks, token_index, first, mask, real_rows)


def _attend_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _GroupPlan, scale: float
) -> torch.Tensor:
    """Attention for one planned group: returns [G * R, Hq, D] float32 in (piece, row) order."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    num_pieces, max_q = group.num_pieces, group.rows_per_piece
    if group.token_index is None:
        qg = q[group.first_token:group.first_token + num_pieces]
    else:
        qg = q.index_select(0, group.token_index)
    # qh: [G, Hkv, R * group, D], rows ordered (query token, head in group): the query heads that
    # share a KV head become extra query rows of it.
    qh = qg.float().reshape(num_pieces, max_q, num_kv_heads, group_size, head_dim)
    qh = qh.transpose(1, 2).reshape(num_pieces, num_kv_heads, max_q * group_size, head_dim)
    # k, v: [G, Hkv, L, D], strided views of the gathered blocks (SDPA reads them in place).
    k = k_cache.index_select(0, group.blocks).float().view(num_pieces, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, group.blocks).float().view(num_pieces, -1, num_kv_heads, head_dim).transpose(1, 2)
    attn = F.scaled_dot_product_attention(qh, k, v, attn_mask=group.mask, scale=scale)
    # attn: [G, Hkv, R * group, D] -> [G * R, Hq, D]
    attn = attn.view(num_pieces, num_kv_heads, max_q, group_size, head_dim).transpose(1, 2)
    return attn.reshape(num_pieces * max_q, num_q_heads, head_dim)
