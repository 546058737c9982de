"""Operator-level A/B of the CPU decode attention: the native kernel against the torch path.

    python bench/cpu_attention.py [--threads 1] [--batches 1,4,16,32,64,128] [--rounds 7]

Real-model shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, block size 16),
context lengths drawn like the engine bench's (a prompt of lognormal(80) tokens plus part of a
lognormal(96) output, 8-1024), block ids scattered over a pool, and `--layers` distinct layer
caches cycled so the K/V of a step does not sit in the last-level cache between calls. Each round
times both sides on the same batch, in alternating order; the table gives the medians per call,
the per-step figure (x 30 layers) and the median of the per-round ratios (torch / kernel).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import time
from typing import Any

import torch

from sluice.kernels import attention, cpu_decode
from sluice.kernels.attention import AttentionMetadata
from sluice.kernels.testing import make_metadata

HQ, HKV, HEAD_DIM, BLOCK_SIZE, LAYERS_PER_STEP = 9, 3, 64, 16, 30


def _context_lengths(batch: int, rng: random.Random) -> list[int]:
    lengths = []
    for _ in range(batch):
        prompt = min(512, max(8, int(rng.lognormvariate(4.38, 0.6))))  # median ~80
        output = min(1024, max(8, int(rng.lognormvariate(4.56, 0.8))))  # median ~96
        lengths.append(prompt + rng.randint(1, output))
    return lengths


def _torch_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
    return attention.paged_attention_torch(q, k, v, meta, scale)


def _native(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: AttentionMetadata,
            scale: float) -> torch.Tensor:
    return kernel.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, scale)


def _time(fn: Any, calls: list[tuple[torch.Tensor, ...]]) -> float:
    start = time.perf_counter()
    for args in calls:
        fn(*args)
    return (time.perf_counter() - start) / len(calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,4,16,32,64,128")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4, help="distinct layer caches cycled")
    parser.add_argument("--extra-context", type=int, default=0,
                        help="tokens added to every context (later steps of a long run)")
    parser.add_argument("--calls", type=int, default=8, help="calls per side per round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_decode.build():
        raise SystemExit("the CPU decode kernel cannot be built here")
    kernel = cpu_decode.KERNEL.module
    scale = HEAD_DIM ** -0.5
    rng = random.Random(0)
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.1f}")
    print("batch  ctx(mean)  torch ms/call  kernel ms/call  torch ms/step  kernel ms/step  ratio")
    for batch in [int(b) for b in args.batches.split(",")]:
        lengths = [n + args.extra_context for n in _context_lengths(batch, rng)]
        gen = torch.Generator().manual_seed(batch)
        meta, _, num_blocks = make_metadata([(1, n) for n in lengths], BLOCK_SIZE, generator=gen, extra_blocks=64)
        layers = [(torch.randn(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, generator=gen),
                   torch.randn(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, generator=gen)) for _ in range(args.layers)]
        q = torch.randn(batch, HQ, HEAD_DIM, generator=gen)
        calls = [(q, *layers[i % args.layers]) for i in range(args.calls)]

        torch_path = functools.partial(_torch_path, meta=meta, scale=scale)
        native = functools.partial(_native, kernel, meta=meta, scale=scale)

        os.environ[cpu_decode.KERNEL.switch] = "0"  # the torch path proper, whatever the dispatch threshold
        torch.testing.assert_close(native(*calls[0]), torch_path(*calls[0]), rtol=1e-5, atol=1e-5)
        torch_path(*calls[0]), native(*calls[0])  # warm-up (plan, oneDNN primitives)
        t_torch, t_kernel, ratios = [], [], []
        for r in range(args.rounds):
            sides = [(torch_path, t_torch), (native, t_kernel)]
            for fn, out in sides if r % 2 == 0 else sides[::-1]:
                out.append(_time(fn, calls))
            ratios.append(t_torch[-1] / t_kernel[-1])
        del os.environ[cpu_decode.KERNEL.switch]
        mt, mk = statistics.median(t_torch) * 1e3, statistics.median(t_kernel) * 1e3
        print(f"{batch:5d}  {sum(lengths) / batch:9.0f}  {mt:13.3f}  {mk:14.3f}  {mt * LAYERS_PER_STEP:13.1f}"
              f"  {mk * LAYERS_PER_STEP:14.1f}  {statistics.median(ratios):5.2f}x")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
