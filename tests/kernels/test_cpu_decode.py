"""The CPU's gather-free paged decode kernel (kernels/cpu_decode.py) against the torch reference.

The `built` fixture (conftest.py) builds the kernel with warnings as errors; the tests skip
where no compiler is available.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sluice.kernels import cpu_build, cpu_decode
from sluice.kernels.attention import paged_attention_ref, paged_attention_torch
from sluice.kernels.linear import linear, pack_weight
from sluice.kernels.testing import make_metadata, make_paged_batch

pytestmark = [pytest.mark.kernels, pytest.mark.timeout(1800)]


NATIVE_KERNEL = cpu_decode.KERNEL  # built by the `built` fixture (conftest.py)


def _decode_case(hq: int, hkv: int, head_dim: int, block_size: int, lengths: list[int], seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    meta, _, num_blocks = make_metadata([(1, n) for n in lengths], block_size, generator=gen)
    k = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    q = torch.randn(len(lengths), hq, head_dim, generator=gen)
    return q, k, v, meta


# (query heads, KV heads, head_dim, block size): the real model's GQA 3, no GQA, GQA 4 and 8 (the
# query heads of a group are done three at a time: 8 = 3 + 3 + 2), head dims that are not a
# multiple of 32 (80: a tail of 16) or of 8 (20, 36: the portable loops), block sizes 1 to 32.
@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 80, 16), (8, 1, 128, 32), (6, 3, 20, 4),
                          (4, 2, 36, 1), (2, 2, 64, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_decode_matches_reference(built: None, hq: int, hkv: int, head_dim: int, block_size: int,
                                      threads: int) -> None:
    """Ragged lengths (1 row, a block, a block and one, long), with many sequences (split by
    sequence) and few (split by KV head), on one and two threads."""
    lengths = [1, 2, block_size, block_size + 1, 37, 300, 5, 9, 700, 64]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for batch in (lengths, lengths[4:6], [lengths[5]]):
            q, k, v, meta = _decode_case(hq, hkv, head_dim, block_size, batch, seed=hq * 100 + head_dim)
            scale = head_dim ** -0.5
            ref = paged_attention_ref(q, k, v, meta, scale)
            out = cpu_decode.paged_decode_cpu(q, k, v, meta.block_tables, meta.seq_lens, scale)
            assert out.shape == ref.shape
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            # The torch backend routes a decode-only batch through the kernel once it is ready.
            assert torch.equal(paged_attention_torch(q, k, v, meta, scale), out)
    finally:
        torch.set_num_threads(before)


def test_a_mixed_batch_sends_its_decodes_to_the_kernel(built: None) -> None:
    """Prefill chunks and decodes in one batch: the decodes go to the kernel, and so does a short
    chunk (a decode with its drafts), as one sequence of 5 query rows; the long chunk goes to the
    padded SDPA groups; together they equal the reference."""
    seqs = [(1, 40), (17, 60), (1, 3), (1, 250), (5, 5), (1, 16)]
    batch = make_paged_batch(seqs, block_size=16, num_q_heads=9, num_kv_heads=3, head_dim=64)
    scale = 0.125
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    out = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (plan,) = batch.meta.plan_cache.values()
    assert plan.native is not None and plan.native.token_index.tolist() == [0, 18, 19, 20, 21, 22, 23, 24, 25]
    assert plan.native.seq_lens.tolist() == [40, 3, 250, 5, 16]
    assert plan.native.query_start_loc is not None
    assert plan.native.query_start_loc.tolist() == [0, 1, 2, 3, 8, 9]
    assert all(group.rows_per_piece > 1 for group in plan.groups)
    # A sequence with no query rows in the step has nothing to attend and no kernel entry.
    batch = make_paged_batch([(1, 40), (0, 7), (3, 9), (17, 30)], block_size=16, num_q_heads=9, num_kv_heads=3,
                             head_dim=64)
    out = paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    torch.testing.assert_close(out, paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale),
                               rtol=1e-5, atol=1e-5)
    (plan,) = batch.meta.plan_cache.values()
    assert plan.native is not None and plan.native.seq_lens.tolist() == [40, 9]


@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (8, 2, 80, 16), (6, 3, 20, 4), (4, 2, 36, 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_verification_chunks_read_the_context_once_and_equal_one_row_calls(
        built: None, hq: int, hkv: int, head_dim: int, block_size: int, threads: int) -> None:
    """Sequences of 1-8 query rows (a decode and its drafts) in one call: each row equals, bit for
    bit, a one-row call over the context up to its own position, and matches the reference; a
    batch made only of such sequences goes through the kernel whole (no padded groups)."""
    seqs = [(1, 40), (5, 300), (8, 8), (2, block_size + 1), (4, 37), (1, 1), (3, 700), (6, 64)]
    batch = make_paged_batch(seqs, block_size=block_size, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                             seed=hq + head_dim)
    q, k, v, meta, scale = batch.q, batch.k_cache, batch.v_cache, batch.meta, head_dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_decode.paged_decode_cpu(q, k, v, meta.block_tables, meta.seq_lens, scale, meta.query_start_loc)
        starts = meta.query_start_loc_host
        for b, (rows, seq_len) in enumerate(seqs):
            for r in range(rows):
                t = starts[b] + r
                one = cpu_decode.paged_decode_cpu(q[t:t + 1], k, v, meta.block_tables[b:b + 1],
                                                  torch.tensor([seq_len - rows + 1 + r], dtype=torch.int32), scale)
                assert torch.equal(out[t:t + 1], one), (b, r)
        torch.testing.assert_close(out, paged_attention_ref(q, k, v, meta, scale), rtol=1e-5, atol=1e-5)
        assert torch.equal(paged_attention_torch(q, k, v, meta, scale), out)
        (plan,) = meta.plan_cache.values()
        assert plan.all_native_decodes and not plan.groups
    finally:
        torch.set_num_threads(before)


def test_query_rows_that_do_not_fit_the_call_are_refused(built: None) -> None:
    batch = make_paged_batch([(2, 10), (1, 5)], block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(RuntimeError, match="query_start_loc must span q"):
        cpu_decode.paged_decode_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                                    batch.meta.seq_lens, 0.25, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="query rows"):
        cpu_decode.paged_decode_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                                    batch.meta.seq_lens, 0.25)


def test_the_switch_turns_the_kernel_off(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CPU_DECODE_KERNEL", "0")
    assert not cpu_decode.KERNEL.ready()
    # an earlier test in this process may have built it in the background: what counts is that
    # no new build starts while the switch is off
    before = cpu_decode.KERNEL._building
    cpu_decode.KERNEL.build_in_background()  # does nothing while off
    assert cpu_decode.KERNEL._building is before
    batch = make_paged_batch([(1, 40), (3, 9)], block_size=16, num_q_heads=9, num_kv_heads=3, head_dim=64)
    paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    (plan,) = batch.meta.plan_cache.values()
    assert plan.native is None


def test_the_cache_key_names_the_cpu_torch_and_source(built: None, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """A -march=native binary is looked for under a key of this CPU (and torch, flags, source):
    a cache shared by machines with other CPUs never hands one of them a foreign binary."""
    path = cpu_decode.KERNEL.path()
    monkeypatch.setattr(cpu_build, "cpu_key", lambda: "x86_64|another CPU|avx2 fma sse2")
    assert cpu_decode.KERNEL.path() != path
    assert cpu_decode.KERNEL.path().name == path.name
    monkeypatch.setenv("SLUICE_KERNEL_CACHE", str(tmp_path))
    assert cpu_decode.KERNEL.path().is_relative_to(tmp_path)


def test_packed_linear_is_the_plain_onednn_call() -> None:
    """Pre-packed weights compute the same sums as the plain oneDNN call from 4 rows up (1-3 rows:
    float32 rounding), with and without bias; bf16 has no packed form."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(960, 576, generator=gen) / 24
    bias = torch.randn(960, generator=gen)
    packed = pack_weight(weight)
    if packed is None:
        pytest.skip("this torch has no oneDNN packing")
    for rows in (1, 4, 64, 513):
        x = torch.randn(rows, 576, generator=gen)
        for b in (bias, None):
            plain, fast = linear(x, weight, b), linear(x, weight, b, packed)
            if rows >= 4:
                assert torch.equal(plain, fast)
            torch.testing.assert_close(fast, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    assert pack_weight(weight.bfloat16()) is None


def test_an_engine_process_loads_the_built_kernel_without_compiling(built: None, tmp_path: Path) -> None:
    """`ready()` (what an engine step asks) imports the built module as it is: a build lock left
    behind (torch's extension loader waited forever on one, stalling an engine until its
    heartbeats were missed) does not matter, and nothing is compiled, also not in the background."""
    cache = tmp_path / "kernels"
    env = {**os.environ, "SLUICE_KERNEL_CACHE": str(cache)}
    where = "from sluice.kernels import cpu_decode; print(cpu_decode.KERNEL.path())"
    found = subprocess.run([sys.executable, "-c", where], env=env, capture_output=True, text=True, timeout=120)
    target = Path(found.stdout.strip())
    target.parent.mkdir(parents=True)
    shutil.copy(cpu_decode.KERNEL.path(), target)
    (target.parent / "lock").touch()  # as a SIGKILLed build of torch's loader leaves it
    (target.parent / "build.lock").touch()
    check = ("from sluice.kernels import cpu_decode; cpu_decode.KERNEL.build_in_background(); "
             "print(cpu_decode.KERNEL.ready())")
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert sorted(p.name for p in target.parent.iterdir()) == ["build.lock", "lock", target.name]  # no build
