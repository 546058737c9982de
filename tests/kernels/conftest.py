"""Kernel tests: Triton's interpreter on CPU tensors when no GPU is present, CUDA when one is.

TRITON_INTERPRET must be set before triton is first imported (it decides at @triton.jit time),
hence at this module's import, before any test module imports sluice.kernels. The native CPU
kernels build with warnings as errors here (SLUICE_KERNEL_WERROR=1, also set at import, before
any build): a warning in kernels/csrc/ fails the kernel tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["SLUICE_KERNEL_WERROR"] = "1"

import pytest

from sluice.kernels.cpu_build import NativeKernel, missing_tools
from sluice.kernels.testing import poisoned_allocations

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

_DEVICE_PARAMS = [
    pytest.param(
        "cpu",
        id="interp",
        marks=pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need TRITON_INTERPRET=1"),
    ),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA device (not interpreted)"
            ),
        ],
    ),
]


@pytest.fixture(params=_DEVICE_PARAMS)
def device(request: pytest.FixtureRequest) -> str:
    """Where the kernels run: 'cpu' under the interpreter, or 'cuda'."""
    return request.param


@pytest.fixture(autouse=True)
def _poison_allocations() -> Iterator[None]:
    """Every floating torch.empty / empty_like is NaN-filled, so unwritten outputs fail."""
    with poisoned_allocations():
        yield


@pytest.fixture(scope="module")
def built(request: pytest.FixtureRequest) -> None:
    """Builds the test module's `NATIVE_KERNEL` (a C++ compile, cached per CPU; a minute or more
    on a loaded 2-core machine), which also makes the engine use it in later tests of the same
    machine. Skips where no compiler or ninja is found, since the engine then runs the torch path;
    fails, with the compiler's messages, where the build itself fails (an error or a warning)."""
    kernel: NativeKernel = request.module.NATIVE_KERNEL
    if kernel.disabled:
        pytest.skip(f"native kernel {kernel.name} is turned off ({kernel.switch}=0)")
    missing = missing_tools()
    if missing:
        pytest.skip(f"native kernel {kernel.name} cannot be built here: no {', '.join(missing)}")
    if not kernel.build():
        pytest.fail(f"native kernel {kernel.name} did not build:\n{kernel.last_failure}", pytrace=False)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """torch's intra-op threads for one test: 1 and 2 (the native kernels split work over them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
