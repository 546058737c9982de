"""One-command GPU check and benchmark of sluice's kernels and engine (H200-sized, <= 8 min).

  python3 bench/gpu_suite.py                # on the GPU machine; JSON to $OUT/gpu_suite.json
  python3 bench/gpu_suite.py --dry-run      # tiny sizes on CPU under Triton's interpreter

Sections:
  1. ceilings: device-to-device copy bandwidth (bytes read + written) and bf16 matmul TFLOP/s,
     both measured here on random data; every later number is a fraction of these.
  2. checks: each Triton kernel against its plain torch reference on fresh random data, with
     NaN-poisoned outputs, at Llama-3-8B shapes (relative error norm, NaN never passes).
  3. kernels: median time (triton.testing.do_bench, which flushes L2 between runs) and achieved
     GB/s or TFLOP/s against the ceiling, for the bytes/FLOPs each kernel must move/do.
  4. engine: bench/gpu_suite_engine.py (Llama-3-8B-shaped random bf16 model); skipped with a
     message if the engine cannot be imported.
A short table is printed last; the JSON is rewritten after every section, so a run cut short
still leaves what it measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))  # sluice is imported from the checkout, not an installed copy
sys.path.insert(0, str(REPO / "bench"))

from gpu_suite_report import Report, Row, bench_ms  # noqa: E402

# ---- 1. ceilings -------------------------------------------------------------------------------


def measure_ceilings(report: Report, device: str, dry: bool) -> None:
    import torch

    on_cuda = device == "cuda"
    # Copy: 2 GiB source, far past L2; bytes counted = read + write.
    n = (1 << 20) if dry else (1 << 30)
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), on_cuda)
    copy_gbs = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
    report.ceilings["copy_GBps"] = copy_gbs
    report.add(Row("ceiling", f"d2d copy {src.numel() * 2 / 2**30:.3f} GiB", ms, copy_gbs, "GB/s"))

    size = 256 if dry else 8192
    a = torch.randn(size, size, device=device, dtype=torch.float32).to(torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.float32).to(torch.bfloat16)
    ms = bench_ms(lambda: a @ b, on_cuda)
    tflops = 2 * size**3 / (ms * 1e-3) / 1e12
    report.ceilings["matmul_TFLOPs"] = tflops
    report.add(Row("ceiling", f"bf16 matmul {size}^3 (random)", ms, tflops, "TFLOP/s"))


# ---- 2. and 3. kernels -------------------------------------------------------------------------

# Llama-3-8B attention/MLP shapes; the dry run shrinks them.
FULL = {"hq": 32, "hkv": 8, "d": 128, "hidden": 4096, "inter": 14336, "bs": 16}
DRY = {"hq": 8, "hkv": 2, "d": 80, "hidden": 96, "inter": 80, "bs": 16}


def _check(report: Report, name: str, out, ref, dtype) -> None:
    from sluice.kernels.testing import rel_error, tolerance

    err = rel_error(out.float().cpu(), ref.float().cpu())
    report.add(Row("check", name, error=err, ok=err < tolerance(dtype)))


def check_kernels(report: Report, device: str, dry: bool) -> None:
    import torch

    from sluice.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
    from sluice.kernels.attention import paged_attention_ref
    from sluice.kernels.ops import paged_attention_triton
    from sluice.kernels.paged_decode import paged_decode_triton
    from sluice.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
    from sluice.kernels.rotary import rotary_store_kv_ref, rotary_store_kv_triton
    from sluice.kernels.testing import make_metadata, make_paged_batch, poisoned_allocations

    s = DRY if dry else FULL
    dtype = torch.bfloat16
    tokens = 5 if dry else 1000
    gen = torch.Generator(device=device).manual_seed(int(time.time()))  # fresh data every run

    def randn(*shape: int, dt=dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(dt)

    with poisoned_allocations():
        x, res, w = randn(tokens, s["hidden"]), randn(tokens, s["hidden"]), randn(s["hidden"])
        out, new_res = rms_norm_triton(x, w, 1e-5, res)
        ref_out, ref_res = rms_norm_ref(x, w, 1e-5, res)
        _check(report, "rms_norm+residual", out, ref_out, dtype)
        _check(report, "rms_norm new residual", new_res, ref_res, dtype)

        x = randn(tokens, 2 * s["inter"])
        _check(report, "silu_and_mul", silu_and_mul_triton(x), silu_and_mul_ref(x), dtype)

        seqs = [(3, 40), (1, 7), (5, 5)] if dry else [(300, 900), (1, 77), (500, 500), (199, 1234)]
        meta, positions, num_blocks = make_metadata(seqs, s["bs"], device)
        t = positions.shape[0]
        qkv = randn(t, (s["hq"] + 2 * s["hkv"]) * s["d"])
        q, k, v = (
            part.view(t, -1, s["d"])
            for part in qkv.split([s["hq"] * s["d"], s["hkv"] * s["d"], s["hkv"] * s["d"]], 1)
        )
        cos_sin = randn(4096, s["d"], dt=torch.float32)
        cache_shape = (num_blocks, s["bs"], s["hkv"], s["d"])
        caches = [torch.full(cache_shape, float("nan"), dtype=dtype, device=device) for _ in range(4)]
        q_rot, k_rot = rotary_store_kv_triton(q, k, v, positions, cos_sin, *caches[:2], meta.slot_mapping)
        ref_q, ref_k = rotary_store_kv_ref(q, k, v, positions, cos_sin, *caches[2:], meta.slot_mapping)
        _check(report, "rotary q", q_rot, ref_q, dtype)
        _check(report, "rotary k", k_rot, ref_k, dtype)
        _check(report, "rotary k cache", caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0), dtype)
        _check(report, "rotary v cache", caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0), dtype)

        scale = s["d"] ** -0.5
        lens = (
            [1, 17, 300] if dry else torch.randint(1, 4097, (24,), generator=torch.Generator().manual_seed(1))
        )
        decode = make_paged_batch(
            [(1, int(n)) for n in lens], block_size=s["bs"], num_q_heads=s["hq"], num_kv_heads=s["hkv"],
            head_dim=s["d"], dtype=dtype, device=device, seed=int(time.time()),
        )  # fmt: skip
        ref = paged_attention_ref(
            decode.q.float(), decode.k_cache.float(), decode.v_cache.float(), decode.meta, scale
        )
        for part in (None, 64 if not dry else 16):
            out = torch.full_like(decode.q, float("nan"))
            paged_decode_triton(decode.q, decode.k_cache, decode.v_cache, decode.meta, scale, out=out,
                                partition_size=part)  # fmt: skip
            _check(report, f"decode ragged partition={part or 'auto'}", out, ref, dtype)

        mixed_seqs = (
            [(9, 40), (1, 23), (20, 20)]
            if dry
            else [(512, 1536), (1, 777), (300, 300), (1, 2000), (64, 4000)]
        )
        mixed = make_paged_batch(
            mixed_seqs, block_size=s["bs"], num_q_heads=s["hq"], num_kv_heads=s["hkv"], head_dim=s["d"],
            dtype=dtype, device=device, seed=int(time.time()) + 1,
        )  # fmt: skip
        ref = paged_attention_ref(
            mixed.q.float(), mixed.k_cache.float(), mixed.v_cache.float(), mixed.meta, scale
        )
        out = paged_attention_triton(mixed.q, mixed.k_cache, mixed.v_cache, mixed.meta, scale)
        _check(report, "prefill+decode mixed batch", out, ref, dtype)


def time_kernels(report: Report, device: str, dry: bool) -> None:
    import torch

    from sluice.kernels.activation import silu_and_mul_triton
    from sluice.kernels.paged_common import TileConfig
    from sluice.kernels.paged_decode import paged_decode_triton
    from sluice.kernels.paged_prefill import paged_prefill_triton
    from sluice.kernels.rmsnorm import rms_norm_triton
    from sluice.kernels.rotary import rotary_store_kv_triton
    from sluice.kernels.testing import make_metadata, make_paged_batch

    on_cuda = device == "cuda"
    s = DRY if dry else FULL
    dtype, elem = torch.bfloat16, 2
    copy_bw = report.ceilings["copy_GBps"] * 1e9
    peak = report.ceilings["matmul_TFLOPs"] * 1e12
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, dt=dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(dt)

    def memory_row(name: str, fn, nbytes: float, note: str = "") -> None:
        ms = bench_ms(fn, on_cuda)
        gbs = nbytes / (ms * 1e-3)
        report.add(Row("kernel", name, ms, gbs / 1e9, "GB/s", gbs / copy_bw, note=note))

    tokens = 8 if dry else 16384
    h, inter = s["hidden"], s["inter"]
    x, res, w = randn(tokens, h), randn(tokens, h), randn(h)
    memory_row(
        f"rms_norm+res T={tokens} H={h}", lambda: rms_norm_triton(x, w, 1e-5, res), 4 * tokens * h * elem
    )
    x = randn(tokens, 2 * inter)
    memory_row(
        f"silu_and_mul T={tokens} I={inter}", lambda: silu_and_mul_triton(x), 3 * tokens * inter * elem
    )

    hq, hkv, d, bs = s["hq"], s["hkv"], s["d"], s["bs"]
    meta, positions, num_blocks = make_metadata([(tokens, tokens)], bs, device)
    qkv = randn(tokens, (hq + 2 * hkv) * d)
    q, k, v = (part.view(tokens, -1, d) for part in qkv.split([hq * d, hkv * d, hkv * d], 1))
    cos_sin = randn(tokens, d, dt=torch.float32)
    k_cache, v_cache = randn(num_blocks, bs, hkv, d), randn(num_blocks, bs, hkv, d)
    # read q, k, v and cos/sin; write q_rot, k_rot and the two cache rows
    rot_bytes = tokens * d * elem * (2 * hq + 5 * hkv) + tokens * d * 4
    memory_row(
        f"rotary_store_kv T={tokens}",
        lambda: rotary_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping),
        rot_bytes,
    )

    scale = d**-0.5
    kv_per_token = 2 * hkv * d * elem  # K and V of one layer
    default = TileConfig(block_m=16, block_n=16) if dry else TileConfig()
    # Launch shapes tried besides the default, each timed once: pick the best in a later change.
    decode_sweep = [TileConfig(block_n=32)] if dry else [TileConfig(block_n=32), TileConfig(block_n=128)]
    prefill_sweep = (
        [TileConfig(block_m=32, block_n=16)]
        if dry
        else [
            TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
            TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
            TileConfig(block_m=128, block_n=32, num_warps=4, num_stages=3),
        ]
    )
    decode_cases = [(1, 64), (4, 32)] if dry else [(b, c) for c in (1024, 4096) for b in (1, 8, 64, 256)]
    for batch, ctx in decode_cases:
        pb = make_paged_batch([(1, ctx)] * batch, block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                              dtype=dtype, device=device)  # fmt: skip
        out = torch.empty_like(pb.q)
        nbytes = batch * ctx * kv_per_token + 2 * pb.q.numel() * elem
        variants: list[tuple[str, TileConfig, int | None]] = [("", default, None)]
        if batch == 1:  # what split-KV buys: the same call forced to one partition
            variants.append((" no split", default, -(-ctx // default.block_n) * default.block_n))
        if ctx == max(c for _, c in decode_cases) and batch in (1, 64):
            variants += [(f" block_n={t.block_n}", t, None) for t in decode_sweep]
        for label, tiles, part in variants:
            memory_row(
                f"decode B={batch} ctx={ctx}{label}",
                lambda pb=pb, out=out, tiles=tiles, part=part: paged_decode_triton(
                    pb.q, pb.k_cache, pb.v_cache, pb.meta, scale, out=out, partition_size=part, tiles=tiles
                ),
                nbytes,
            )
        del pb, out

    prefill_cases = [(16, 16), (8, 40)] if dry else [(2048, 2048), (8192, 8192), (2048, 8192)]
    for q_len, seq_len in prefill_cases:
        pb = make_paged_batch([(q_len, seq_len)], block_size=bs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                              dtype=dtype, device=device)  # fmt: skip
        out = torch.empty_like(pb.q)
        # Row i sees (seq_len - q_len + i + 1) keys; QK^T and PV cost 2 * D FLOPs each per key.
        visible = q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2
        flops = 4 * hq * d * visible
        sweep = prefill_sweep if q_len == seq_len == max(n for n, _ in prefill_cases) else []
        for tiles in [default, *sweep]:
            label = (
                ""
                if tiles is default
                else f" tiles={tiles.block_m}x{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}"
            )
            ms = bench_ms(
                lambda pb=pb, out=out, tiles=tiles: paged_prefill_triton(
                    pb.q, pb.k_cache, pb.v_cache, pb.meta, scale, out=out, tiles=tiles
                ),
                on_cuda,
            )
            rate = flops / (ms * 1e-3)
            name = f"prefill q={q_len} ctx={seq_len}{label}"
            report.add(Row("kernel", name, ms, rate / 1e12, "TFLOP/s", rate / peak))
        del pb, out


# ---- table and entry point ---------------------------------------------------------------------


def print_table(report: Report) -> None:
    print("\n=== gpu_suite summary ===")
    print(f"device: {report.device}  dry_run: {report.dry_run}")
    for key, value in report.ceilings.items():
        print(f"ceiling {key}: {value:.1f}")
    print(f"{'section':8} {'name':44} {'ms':>10} {'achieved':>16} {'of ceil':>8} {'check':>14}")
    for r in report.rows:
        if r.section == "ceiling":
            continue
        ms = "" if r.ms is None else f"{r.ms:10.4f}"
        ach = "" if r.achieved is None else f"{r.achieved:9.1f} {r.unit:>6}"
        frac = "" if r.fraction is None else f"{100 * r.fraction:7.1f}%"
        chk = "" if r.error is None else f"{r.error:.1e} {'ok' if r.ok else 'FAIL'}"
        print(f"{r.section:8} {r.name[:44]:44} {ms:>10} {ach:>16} {frac:>8} {chk:>14} {r.note}".rstrip())
    failed = [r.name for r in report.rows if r.ok is False]
    print(f"checks: {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}")


def _guarded(report: Report, section: str, fn, *args, **kwargs) -> None:
    """Runs one section; an exception becomes a failed row (with its traceback on stderr) so
    the other sections and the table still come out of a single device call."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        traceback.print_exc()
        report.add(Row(section, "section crashed", ok=False, note=f"{type(exc).__name__}: {exc}"[:300]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU under Triton's interpreter")
    parser.add_argument(
        "--json", type=Path, default=None, help="where to write JSON (default $OUT/gpu_suite.json)"
    )
    parser.add_argument("--skip-engine", action="store_true", help="skip section 4")
    parser.add_argument("--skip-hf", action="store_true", help="skip the HF generate comparison in section 4")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="engine cases starting after this many seconds are skipped",
    )
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the engine model (8B: 32)")
    args = parser.parse_args(argv)

    import torch

    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before sluice.kernels first imports triton
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA device: run with --dry-run (Triton's interpreter on CPU)", file=sys.stderr)
        return 2
    json_path = args.json
    if json_path is None and os.environ.get("OUT"):
        json_path = Path(os.environ["OUT"]) / "gpu_suite.json"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)"
    report = Report(json_path, name, args.dry_run)
    print(f"gpu_suite on {name}; torch {torch.__version__}", flush=True)

    started = time.perf_counter()
    with torch.inference_mode():
        _guarded(report, "ceiling", measure_ceilings, report, device, args.dry_run)
        if report.ceilings:
            _guarded(report, "check", check_kernels, report, device, args.dry_run)
            _guarded(report, "kernel", time_kernels, report, device, args.dry_run)
    if args.skip_engine or not report.ceilings:
        report.add(Row("engine", "skipped", note="--skip-engine" if args.skip_engine else "no ceilings"))
    else:
        from gpu_suite_engine import run_engine_section

        if device == "cuda":
            torch.cuda.empty_cache()  # section 3's tensors are gone; give the engine the memory
        _guarded(
            report,
            "engine",
            run_engine_section,
            report,
            device,
            args.dry_run,
            layers=args.layers,
            skip_hf=args.skip_hf,
            deadline=started + args.budget_s,
        )
    report.add(Row("total", "wall time", (time.perf_counter() - started) * 1e3))
    print_table(report)
    return 0 if all(r.ok is not False for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
