"""Operator-level A/B of the CPU decode attention: the native kernel against the torch path.

    python bench/cpu_attention.py [--threads 1] [--batches 1,4,16,32,64,128] [--rounds 7]
        [--contexts drawn,128,512,1024] [--rows 5] [--baseline path/to/another/sluice_cpu_paged_decode.so]

Real-model shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, block size 16),
context lengths drawn like the engine bench's (a prompt of lognormal(80) tokens plus part of a
lognormal(96) output, 8-1024), block ids scattered over a pool, and `--layers` distinct layer
caches cycled so the K/V of a step does not sit in the last-level cache between calls. Each round
times both sides on the same batch, in alternating order; the table gives the medians per call,
the per-step figure (x 30 layers), the kernel's K/V read rate (GB/s: the bytes of the cached rows
it attends to, over its median time) and the median of the per-round ratios (torch / kernel).
`--contexts` adds fixed context lengths (every sequence that long) to the drawn ones; `--baseline`
times another build of the kernel (e.g. main's, copied out of the kernel cache) as a third side
and adds its GB/s and the median per-round ratio baseline / kernel. `--rows R` gives every
sequence R query rows (a decode and R - 1 speculative drafts: a verification chunk) instead of one.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
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
    starts = torch.empty(0, dtype=torch.int32) if meta.is_decode_only else meta.query_start_loc
    try:
        return kernel.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, starts, scale)
    except TypeError:  # a baseline built before the kernel took query_start_loc: one row each
        return kernel.paged_decode(q, k, v, meta.block_tables, meta.seq_lens, scale)


def _load_baseline(path: str) -> Any:
    """Another build of the kernel, loaded beside this one (its own shared object; same API)."""
    spec = importlib.util.spec_from_file_location("sluice_cpu_paged_decode", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    parser.add_argument("--contexts", default="drawn",
                        help="'drawn' (lengths like the engine bench's) and/or fixed lengths, comma-separated")
    parser.add_argument("--rows", type=int, default=1, help="query rows per sequence (1: plain decodes)")
    parser.add_argument("--baseline", help="a built .so of another version of the kernel, timed as a third side")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_decode.KERNEL.build():
        raise SystemExit("the CPU decode kernel cannot be built here")
    kernel = cpu_decode.KERNEL.module
    scale = HEAD_DIM ** -0.5
    rng = random.Random(0)
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.1f}")
    baseline = _load_baseline(args.baseline) if args.baseline else None
    print("batch  ctx(mean)  torch ms/call  kernel ms/call  torch ms/step  kernel ms/step  kernel GB/s  ratio"
          + ("  base GB/s  base/kernel" if baseline else ""))
    cases = [(int(b), c) for c in args.contexts.split(",") for b in args.batches.split(",")]
    for batch, context in cases:
        drawn = _context_lengths(batch, rng) if context == "drawn" else [int(context)] * batch
        lengths = [n + args.extra_context for n in drawn]
        gen = torch.Generator().manual_seed(batch)
        meta, _, num_blocks = make_metadata([(args.rows, max(n, args.rows)) for n in lengths], BLOCK_SIZE,
                                            generator=gen, extra_blocks=64)
        layers = [(torch.randn(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, generator=gen),
                   torch.randn(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, generator=gen)) for _ in range(args.layers)]
        q = torch.randn(batch * args.rows, HQ, HEAD_DIM, generator=gen)
        calls = [(q, *layers[i % args.layers]) for i in range(args.calls)]

        torch_path = functools.partial(_torch_path, meta=meta, scale=scale)
        native = functools.partial(_native, kernel, meta=meta, scale=scale)
        base = functools.partial(_native, baseline, meta=meta, scale=scale) if baseline else None

        os.environ[cpu_decode.KERNEL.switch] = "0"  # the torch path proper, whatever the dispatch threshold
        torch.testing.assert_close(native(*calls[0]), torch_path(*calls[0]), rtol=1e-5, atol=1e-5)
        torch_path(*calls[0]), native(*calls[0])  # warm-up (plan, oneDNN primitives)
        if base:
            torch.testing.assert_close(base(*calls[0]), torch_path(*calls[0]), rtol=1e-5, atol=1e-5)
        t_torch: list[float] = []
        t_kernel: list[float] = []
        t_base: list[float] = []
        ratios, base_ratios = [], []
        for r in range(args.rounds):
            sides = [(torch_path, t_torch), (native, t_kernel)] + ([(base, t_base)] if base else [])
            for fn, out in sides if r % 2 == 0 else sides[::-1]:
                out.append(_time(fn, calls))
            ratios.append(t_torch[-1] / t_kernel[-1])
            if base:
                base_ratios.append(t_base[-1] / t_kernel[-1])
        del os.environ[cpu_decode.KERNEL.switch]
        mt, mk = statistics.median(t_torch) * 1e3, statistics.median(t_kernel) * 1e3
        kv_bytes = sum(lengths) * HKV * HEAD_DIM * 4 * 2  # K and V rows attended to, float32
        line = (f"{batch:5d}  {sum(lengths) / batch:9.0f}  {mt:13.3f}  {mk:14.3f}  {mt * LAYERS_PER_STEP:13.1f}"
                f"  {mk * LAYERS_PER_STEP:14.1f}  {kv_bytes / mk / 1e6:11.1f}  {statistics.median(ratios):5.2f}x")
        if base:
            line += (f"  {kv_bytes / statistics.median(t_base) / 1e9:9.1f}"
                     f"  {statistics.median(base_ratios):10.2f}x")
        print(line)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
