"""Greedy generation on the demo model: the Triton backend (interpreted on CPU) must produce
exactly the tokens of the torch backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.kernels, pytest.mark.slow]

demo = pytest.importorskip("sluice.workers.demo", reason="the demo model builder does not exist yet")
engine_mod = pytest.importorskip("sluice.workers.engine", reason="the engine does not exist yet")

from sluice.kernels.ops import Ops  # noqa: E402
from sluice.protocol import SamplingParams  # noqa: E402
from sluice.workers.config import EngineConfig  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 200, 13]]


def _engine(model_dir: Path, backend: str):
    config = EngineConfig(model=str(model_dir), device="cpu", kernel_backend=backend, max_num_seqs=4,
                          num_kv_blocks=16, use_cuda_graphs=False)  # fmt: skip
    return engine_mod.LLMEngine(config)


def _triton_engine(model_dir: Path):
    """The runner only accepts kernel_backend='triton' on CUDA; on CPU build the torch engine
    and hand its model the Triton ops (run by the interpreter) instead."""
    try:
        return _engine(model_dir, "triton")
    except ValueError:
        engine = _engine(model_dir, "torch")
        ops = Ops("triton")
        engine.runner.ops = ops
        engine.runner.model.ops = ops
        return engine


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU interpreter check; GPUs run bench/gpu_suite.py"
)
def test_triton_backend_matches_torch_backend_greedy(tmp_path: Path) -> None:
    model_dir = demo.make_demo_model(tmp_path / "demo", seed=0)
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for name, engine in (("torch", _engine(model_dir, "torch")), ("triton", _triton_engine(model_dir))):
        assert engine.runner.model.ops.backend == name
        tokens[name] = [r.token_ids for r in engine.generate(PROMPTS, sampling)]
    assert all(len(t) == 8 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]
