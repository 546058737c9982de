"""Checks every Triton launcher runs first: where its tensors live.

Triton kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, set before triton is first imported: the tests and `--dry-run` do this).
Anything else would fail deep inside Triton with a message about pointers; this says why.
"""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """Raises ValueError unless all tensors share one device that Triton can run on."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"{op}: all tensors must be on one device, got {names}")
    device = next(iter(devices))
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise ValueError(
            f"{op}: Triton kernels need CUDA tensors (got {device}); use the 'torch' kernel backend "
            "on CPU, or set TRITON_INTERPRET=1 before importing triton to run the interpreter"
        )


@functools.cache
def num_multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
