"""Loading HF model directories: sharded checkpoints, and clear errors for garbage directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice.kernels.ops import Ops
from sluice.workers.config import EngineConfig
from sluice.workers.engine import LLMEngine
from sluice.workers.model import ModelLoadError, load_model

pytestmark = pytest.mark.integration

CPU = torch.device("cpu")


def _load(path: Path):
    return load_model(path, Ops("torch"), torch.float32, CPU, max_position=64)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    """A copy of the model directory `src` whose config.json has `changes` applied."""
    d = _copy(src, dst)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | changes))
    return d


def test_sharded_checkpoint_loads_same_weights(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    ours_sharded, _ = _load(sharded)
    ours_single, _ = _load(tiny_llama_dir)
    single = dict(ours_single.named_parameters())
    for name, param in ours_sharded.named_parameters():
        assert torch.equal(param, single[name]), name


def test_missing_shard_is_named(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"{victim.name}: listed in model.safetensors.index.json"):
        _load(tmp_path)


def test_unsupported_architecture(tmp_path: Path, tiny_llama_dir: Path) -> None:
    d = _with_config(tiny_llama_dir, tmp_path / "m", architectures=["FalconForCausalLM"])
    with pytest.raises(ModelLoadError, match="unsupported architecture FalconForCausalLM"):
        _load(d)


def test_no_weights(tmp_path: Path, tiny_llama_dir: Path) -> None:
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        _load(d)


def test_corrupt_safetensors(tmp_path: Path, tiny_llama_dir: Path) -> None:
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-not-json")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        _load(d)


def test_truncated_safetensors(tmp_path: Path, tiny_llama_dir: Path) -> None:
    d = _copy(tiny_llama_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        _load(d)


def test_shape_mismatch_names_tensor(tmp_path: Path, tiny_llama_dir: Path) -> None:
    d = _with_config(tiny_llama_dir, tmp_path / "m", intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        _load(d)


def test_missing_tensor_is_named(tmp_path: Path, tiny_llama_dir: Path) -> None:
    d = _copy(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing weights for layers\.1\.self_attn\.qkv_proj\.weight"):
        _load(d)


def test_missing_tokenizer_fails_engine(tmp_path: Path, tiny_llama_dir: Path) -> None:
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing tokenizer\.json"):
        LLMEngine(EngineConfig(model=str(d)))


def test_not_a_model_dir(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match=r"config\.json: missing"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
