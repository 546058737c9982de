"""ModelRunner: all tensor work of one engine step.

`execute(SchedulerOutput) -> RunnerOutput`: flattens the scheduled chunks into one batch
(token ids, positions, cache slots, AttentionMetadata), runs the model, computes logits only
for the rows that sample, and samples. Owns the model, the paged KV pool (one (k, v) pair per
layer, each [num_blocks + 1, block_size, num_kv_heads, head_dim]; the extra last block is a
scratch block for CUDA-graph padding rows and is never handed to the scheduler) and the
per-request sampling seeds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sluice.grammar.compiler import Matcher
from sluice.kernels import native
from sluice.kernels.attention import AttentionMetadata
from sluice.kernels.ops import Ops
from sluice.protocol import PositionLogprobs
from sluice.workers.config import EngineConfig
from sluice.workers.grammar_mask import MaskFiller
from sluice.workers.model.config import ModelConfig
from sluice.workers.model.cuda_graphs import DecodeGraphRunner
from sluice.workers.model.llama import LlamaForCausalLM
from sluice.workers.model.loader import load_model
from sluice.workers.sampler import Continued, SampleRow, apply_bias_and_mask, sample
from sluice.workers.scheduler import RunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Activation headroom kept free on CUDA besides the weights and the KV pool.
_CUDA_RESERVE_BYTES = 1 << 30


def available_host_memory() -> int:
    """Bytes the host can still hand out: MemAvailable on Linux, else free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(slots=True)
class GrammarStats:
    """What constrained rows cost the runner (read by benchmarks): steps with a constrained row,
    such rows, seconds waited for their masks after the forward pass (the fill runs beside it),
    and seconds spent applying them."""

    steps: int = 0
    rows: int = 0
    wait_s: float = 0.0
    apply_s: float = 0.0


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {config.device!r} requested but CUDA is not available")
            if self.device.index is None:  # plain "cuda": the current device, named (set_device needs an index)
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)  # Triton launches on the current device
        self.dtype = _DTYPES[config.resolved_dtype]
        backend = config.resolved_kernel_backend
        if backend == "triton" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "kernel_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for tests); "
                "use 'torch' on the CPU"
            )
        self.ops = Ops(backend)  # type: ignore[arg-type]
        if self.device.type == "cpu" and self.dtype == torch.float32:
            native.build_all_in_background()  # the torch path runs until each is built
        log.info("engine: kernel backend %s on %s (%s)", backend, self.device, config.resolved_dtype)

        model_cfg = ModelConfig.from_dir(Path(config.model))
        max_len = config.max_model_len or model_cfg.max_position_embeddings
        if max_len > model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's context of "
                f"{model_cfg.max_position_embeddings} tokens"
            )
        self.max_model_len = max_len
        self.model: LlamaForCausalLM
        self.model, self.model_config = load_model(Path(config.model), self.ops, self.dtype, self.device,
                                                   max_position=max_len)
        self.block_size = config.block_size
        self.num_kv_blocks = self._pool_size()
        shape = (self.num_kv_blocks + 1, self.block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(model_cfg.num_layers)]
        self.scratch_block = self.num_kv_blocks
        self._seeds: dict[str, int] = {}  # per request: its own seed, or one drawn for it
        self._seed_source = random.Random(config.seed)
        # Grammar masks: filled beside the forward pass only where torch's threads leave a core free.
        self._masks = MaskFiller(self.model_config.vocab_size,
                                 overlap=self.device.type != "cpu" or torch.get_num_threads() < (os.cpu_count() or 1))
        self.grammar_stats = GrammarStats()
        self._graphs: DecodeGraphRunner | None = None
        if self.device.type == "cuda" and config.use_cuda_graphs:
            self._graphs = DecodeGraphRunner(self.model, self.kv_caches, self.device,
                                             max_batch=config.max_num_seqs, block_size=self.block_size,
                                             max_model_len=max_len, scratch_block=self.scratch_block)

    def _bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _pool_size(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self._bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free) - _CUDA_RESERVE_BYTES
        elif self.config.kv_cache_bytes is not None:
            budget = self.config.kv_cache_bytes
        else:
            # A fraction of what the host has left after the weights, and never more than the
            # running sequences can fill (the pool is zero-filled lazily, but the cap keeps a small
            # model on a big host from claiming memory it cannot use).
            most = self.config.max_num_seqs * -(-self.max_model_len // self.block_size) * per_block
            budget = min(int(available_host_memory() * self.config.cpu_memory_utilization), most)
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"the KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        return int(blocks)

    # ---- per-request state ---------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        """Forget a finished request's seed."""
        self._seeds.pop(request_id, None)

    def _seed(self, request_id: str, seed: int | None) -> int:
        """A seeded request samples from its own seed; an unseeded one from a seed drawn once (from
        the engine's seed), so its preemptions do not change its tokens. Sampling is a function of
        (seed, output position) alone (sampler.uniform): no generator state to keep or move."""
        if seed is not None:
            return seed
        drawn = self._seeds.get(request_id)
        if drawn is None:
            drawn = self._seeds[request_id] = self._seed_source.getrandbits(63)
        return drawn

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        chunks = scheduled.chunks
        if not chunks:
            return RunnerOutput(sampled_token_ids={})
        ids, positions, meta = self._prepare(scheduled)
        # The constrained rows' masks (computed while the model runs, where that pays: MaskFiller).
        mask_rows, fills = self._grammar_rows(scheduled)
        masks = self._masks.start(fills) if fills else None
        hidden: torch.Tensor | None = None
        try:
            if self._graphs is not None and meta.is_decode_only and self._graphs.can_run(meta.num_seqs):
                hidden = self._graphs.run(ids, positions, meta)  # None if capture failed: run eagerly
            if hidden is None:
                hidden = self.model(ids, positions, self.kv_caches, meta)  # [T, H]
        except BaseException:
            if masks is not None:  # the matchers are the scheduler's again only once the fill is over
                with contextlib.suppress(Exception):
                    masks()
            raise
        sample_chunks = [(b, c) for b, c in enumerate(chunks) if c.sample]
        wait_start = time.perf_counter()
        bitmask = masks() if masks is not None else None  # before any early return
        if masks is not None:
            self.grammar_stats.steps += 1
            self.grammar_stats.rows += len(mask_rows)
            self.grammar_stats.wait_s += time.perf_counter() - wait_start
        if not sample_chunks:
            return RunnerOutput(sampled_token_ids={})
        # A sampling chunk samples at its last num_sample_rows rows: its last token and each draft.
        last_rows = [row for b, c in sample_chunks
                     for row in range(meta.query_start_loc_host[b + 1] - c.num_sample_rows,
                                      meta.query_start_loc_host[b + 1])]
        if len(last_rows) < hidden.shape[0]:  # else every row samples (a decode-only step): no gather
            hidden = hidden[torch.tensor(last_rows, device=self.device)]
        logits = self.model.compute_logits(hidden)  # [N, V]
        rows = []
        for _, c in sample_chunks:
            req = c.request
            seed = None if req.sampling.greedy else self._seed(req.request_id, req.sampling.seed)
            rows.append(SampleRow(req.sampling, req.prompt_token_ids, req.output_token_ids, seed))
            for j in range(1, c.num_sample_rows):  # after draft j - 1: as if drafts[:j] were output
                output = Continued(req.output_token_ids, c.draft_token_ids[:j])
                rows.append(SampleRow(req.sampling, req.prompt_token_ids, output, seed))
        apply_start = time.perf_counter()
        logits = apply_bias_and_mask(logits, rows, mask_rows, bitmask, in_place=True)  # logits are ours
        if masks is not None:
            self.grammar_stats.apply_s += time.perf_counter() - apply_start
        out = sample(logits, rows)
        sampled: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, tuple[PositionLogprobs, ...]] = {}
        i = 0
        for _, c in sample_chunks:
            n = c.num_sample_rows
            rid = c.request.request_id
            sampled[rid] = tuple(out.token_ids[i:i + n])
            row_logprobs = out.logprobs[i:i + n]
            if row_logprobs[0] is not None:
                logprobs[rid] = tuple(lp for lp in row_logprobs if lp is not None)
            i += n
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _grammar_rows(scheduled: SchedulerOutput) -> tuple[list[int], list[tuple[Matcher, tuple[int, ...]]]]:
        """The sample rows under a grammar, ascending (the rows `execute` builds: per sampling chunk,
        its last token, then one per draft), and (matcher, drafts) of each constrained chunk, whose
        masks fill those rows in the same order."""
        rows: list[int] = []
        fills: list[tuple[Matcher, tuple[int, ...]]] = []
        row = 0
        for c in scheduled.chunks:
            if not c.sample:
                continue
            grammar = c.request.grammar
            if grammar is not None:
                rows.extend(range(row, row + c.num_sample_rows))
                fills.append((grammar, c.draft_token_ids))
            row += c.num_sample_rows
        return rows, fills

    def _prepare(self, scheduled: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat inputs for the chunks: ids/positions/slots [T], block tables [B, max_blocks]."""
        bs = self.block_size
        chunks = scheduled.chunks
        token_ids: list[int] = []
        q_lens = np.empty(len(chunks), dtype=np.int64)
        seq_lens = np.empty(len(chunks), dtype=np.int64)
        for b, c in enumerate(chunks):
            token_ids.extend(c.input_token_ids())
            q_lens[b] = c.num_tokens
            seq_lens[b] = c.start + c.num_tokens
        max_blocks = int((seq_lens.max() + bs - 1) // bs)
        tables = np.zeros((len(chunks), max_blocks), dtype=np.int64)
        for b, c in enumerate(chunks):
            n = int((seq_lens[b] + bs - 1) // bs)
            if len(c.block_ids) < n:
                raise RuntimeError(f"request {c.request.request_id}: {len(c.block_ids)} blocks for "
                                   f"{seq_lens[b]} tokens")
            tables[b, :n] = c.block_ids[:n]
        starts = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])
        seq_index = np.repeat(np.arange(len(chunks)), q_lens)  # [T]: chunk of each token
        positions = np.arange(starts[-1]) - starts[:-1][seq_index] + (seq_lens - q_lens)[seq_index]
        slots = tables[seq_index, positions // bs] * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(starts.astype(np.int32)).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev, non_blocking=True),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_host=tuple(starts.tolist()),
            seq_lens_host=tuple(seq_lens.tolist()),
        )
        ids = torch.tensor(token_ids, dtype=torch.int64).to(dev, non_blocking=True)
        return ids, torch.from_numpy(positions).to(dev, non_blocking=True), meta
