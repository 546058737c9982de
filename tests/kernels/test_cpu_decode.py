"""The CPU's gather-free paged decode kernel (kernels/cpu_decode.py) against the torch reference.

The first test builds the kernel (a C++ compile: a minute or more on a loaded 2-core machine),
which also makes the engine use it in later tests of the same machine; it skips where no
compiler is available, since the engine then runs the torch path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sluice.kernels import cpu_decode
from sluice.kernels.attention import paged_attention_ref, paged_attention_torch
from sluice.kernels.linear import linear, pack_weight
from sluice.kernels.testing import make_metadata

pytestmark = [pytest.mark.kernels, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def built() -> None:
    if not cpu_decode.build():
        pytest.skip("the CPU decode kernel cannot be built here (no C++ compiler or ninja)")


@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size"), [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 80, 16)])
def test_cpu_decode_matches_reference(built: None, hq: int, hkv: int, head_dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(hq * 100 + head_dim)
    seqs = [(1, n) for n in (1, 2, block_size, block_size + 1, 37, 300, 5)]
    meta, _, num_blocks = make_metadata(seqs, block_size, generator=gen)
    k = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    q = torch.randn(len(seqs), hq, head_dim, generator=gen)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(q, k, v, meta, scale)
    out = cpu_decode.paged_decode_cpu(q, k, v, meta.block_tables, meta.seq_lens, scale)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The torch backend routes a small decode-only batch through the kernel once it is ready (a
    # larger one takes the padded SDPA path, faster there); both agree with the reference.
    assert cpu_decode.ready()
    torch.testing.assert_close(paged_attention_torch(q, k, v, meta, scale), ref, rtol=1e-5, atol=1e-5)
    small, _, small_blocks = make_metadata(seqs[:3], block_size, generator=gen)
    ks, vs = k[:small_blocks].contiguous(), v[:small_blocks].contiguous()
    direct = cpu_decode.paged_decode_cpu(q[:3], ks, vs, small.block_tables, small.seq_lens, scale)
    assert torch.equal(paged_attention_torch(q[:3].contiguous(), ks, vs, small, scale), direct)


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


def test_an_engine_process_loads_the_built_kernel_without_the_extension_loader(built: None, tmp_path: Path) -> None:
    """`ready()` (what an engine step asks) imports the built module as it is: a build lock left
    by a killed build (which made the extension loader wait forever, stalling the engine until its
    heartbeats were missed) and sources it would rebuild from do not matter."""
    cache = tmp_path / "kernels"
    target = cache / cpu_decode.build_directory().name
    target.mkdir(parents=True)
    shutil.copy(cpu_decode.build_directory() / f"{cpu_decode.build_directory().name}.so", target)
    (target / "lock").touch()  # as a SIGKILLed build leaves it
    env = {**os.environ, "SLUICE_KERNEL_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", "from sluice.kernels import cpu_decode; print(cpu_decode.ready())"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert not (target / "main.o").exists()  # nothing was compiled
