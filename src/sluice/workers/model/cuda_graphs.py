"""CUDA graphs for decode-only steps (one new token per sequence), by batch-size bucket.

A decode step of a small model is dominated by kernel-launch overhead; replaying a captured
graph removes it. Graphs are captured lazily, one per bucket, over static input buffers; a
batch of n sequences runs in the smallest bucket >= n, with padding rows that write their K/V
into the scratch block (never handed to the scheduler) and attend to that one slot only.
Used only with the Triton backend: the torch reference attention loops over host-side
sequence lengths, which a graph would freeze. Never constructed on the CPU.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sluice.kernels.attention import AttentionMetadata
from sluice.workers.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device, *, max_batch: int, block_size: int, max_model_len: int,
                 scratch_block: int) -> None:
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.enabled = model.ops.backend == "triton"
        self.buckets = (*(b for b in _BUCKETS if b < max_batch), max_batch)
        self.block_size, self.max_model_len, self.scratch_block = block_size, max_model_len, scratch_block
        max_blocks = -(-max_model_len // block_size)
        n = self.buckets[-1]
        # Static buffers: each captured graph reads from and writes to these exact tensors.
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=model.embed_tokens.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # memory pool handle shared by every captured graph

    def can_run(self, num_seqs: int) -> bool:
        return self.enabled and num_seqs <= self.buckets[-1]

    def _meta(self, bucket: int) -> AttentionMetadata:
        # Host tuples are placeholders: the Triton path reads only the device tensors and the
        # max lengths, set to their largest values so any replay fits the captured launch grid.
        return AttentionMetadata(
            slot_mapping=self.slots[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_host=tuple(range(bucket + 1)),
            seq_lens_host=(self.max_model_len,) * bucket,
        )

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        self._fill_padding(0, bucket)
        meta = self._meta(bucket)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the graph (autotuning, allocations)
            for _ in range(2):
                self.model(self.ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(self.ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
            self.hidden[:bucket].copy_(out)
        self.pool = graph.pool()
        return graph

    def _fill_padding(self, start: int, end: int) -> None:
        if end <= start:
            return
        self.ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = self.scratch_block * self.block_size
        self.seq_lens[start:end] = 1
        self.block_tables[start:end] = self.scratch_block

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """ids, positions: [n]; meta: decode-only -> hidden [n, H], or None when capture failed
        (graphs are then switched off for good, with a warning, and the caller runs eagerly)."""
        n = meta.num_seqs
        bucket = next(b for b in self.buckets if b >= n)
        if bucket not in self.graphs:
            try:
                self.graphs[bucket] = self._capture(bucket)
            except RuntimeError as exc:
                log.warning("CUDA graph capture failed for batch %d (%s); decoding without graphs",
                            bucket, exc)
                self.enabled = False
                return None
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:] = 0
        self._fill_padding(n, bucket)
        self.graphs[bucket].replay()
        return self.hidden[:n]
