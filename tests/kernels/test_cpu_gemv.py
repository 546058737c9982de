"""The native skinny projection (kernels/cpu_gemv.py) against torch's, and `Ops.linear`'s hand-over to it.

The `built` fixture (conftest.py) builds the kernel with warnings as errors; the tests skip
where no compiler is available.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels import cpu_gemv
from sluice.kernels.linear import pack_weight
from sluice.kernels.ops import Ops

pytestmark = [pytest.mark.kernels, pytest.mark.timeout(1800)]

NATIVE_KERNEL = cpu_gemv.KERNEL  # built by the `built` fixture (conftest.py)


@pytest.fixture
def vectorised(built: None) -> None:
    assert cpu_gemv.KERNEL.module is not None
    if not cpu_gemv.KERNEL.module.vectorised():
        pytest.skip("this CPU has no AVX2/FMA: linear keeps oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (8, 1), (64, 13), (576, 49152)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_torch(vectorised: None, threads: int, rows: int, k: int, n: int,
                                     with_bias: bool) -> None:
    """Every output row and column (the tile remainders too) within float32 rounding of F.linear."""
    gen = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, 2 * k, generator=gen)[:, :k]  # strided rows, as a split gives
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = cpu_gemv.skinny_linear(x, weight, bias)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, F.linear(x.double(), weight.double(), None if bias is None else bias.double())
                               .float(), rtol=2e-5, atol=2e-5 * k ** 0.5)


def test_linear_hands_over_only_what_the_kernel_takes(vectorised: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a float32 CPU step, up to MAX_ROWS rows with K % 8 == 0 go to the kernel; more rows or
    another K take oneDNN, and a float64 step never asks: the result is the projection either way."""
    monkeypatch.delenv(cpu_gemv.KERNEL.switch, raising=False)  # on by default
    calls: list[int] = []
    kernel = cpu_gemv.skinny_linear

    def recorded(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])  # the real kernel runs; the wrapper only records the hand-over
        return kernel(x, w, b)

    monkeypatch.setattr(cpu_gemv, "skinny_linear", recorded)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 64, generator=gen)
    packed = pack_weight(weight)
    ops = Ops("torch")
    for rows, k, dtype in [(1, 64, torch.float32), (4, 64, torch.float32), (5, 64, torch.float32),
                           (2, 60, torch.float32), (2, 64, torch.float64)]:
        w = weight[:, :k].contiguous().to(dtype)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        ops.begin_step(x, dtype)
        calls.clear()
        out = ops.linear(x, w, None, packed if k == 64 and dtype == torch.float32 else None)
        assert calls == ([rows] if rows <= cpu_gemv.MAX_ROWS and k == 64 and dtype == torch.float32 else [])
        torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_bad_arguments_are_refused_not_misread(vectorised: None) -> None:
    """A call outside the kernel's contract raises (never reads past a tensor)."""
    module = cpu_gemv.KERNEL.module
    assert module is not None
    with pytest.raises(RuntimeError):
        module.skinny_linear(torch.randn(5, 64), torch.randn(8, 64), None)  # too many rows
    with pytest.raises(RuntimeError):
        module.skinny_linear(torch.randn(1, 60), torch.randn(8, 60), None)  # K % 8
    with pytest.raises(RuntimeError):
        module.skinny_linear(torch.randn(1, 64), torch.randn(8, 32), None)  # shapes
    with pytest.raises(RuntimeError):
        module.skinny_linear(torch.randn(1, 64), torch.randn(8, 64), torch.randn(7))  # bias length


def test_the_switch_turns_the_kernel_off(vectorised: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_gemv.KERNEL.switch, raising=False)
    assert cpu_gemv.ready()
    monkeypatch.setenv(cpu_gemv.KERNEL.switch, "0")
    assert not cpu_gemv.ready()
    ops = Ops("torch")
    ops.begin_step(torch.randn(1, 64), torch.float32)
    assert not ops._skinny
