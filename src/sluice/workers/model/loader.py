"""Load a local Hugging Face model directory into our `LlamaForCausalLM`.

Reads config.json (ModelConfig), then every tensor from model.safetensors or the shards named
by model.safetensors.index.json, copying HF's separate q/k/v and gate/up projections into our
fused parameters. Every failure is a `ModelLoadError` naming the file and the problem.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from sluice.kernels.ops import Ops
from sluice.workers.model.config import ModelConfig, ModelLoadError
from sluice.workers.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF sub-name inside a layer -> (our sub-name, index of the fused part or None)
_LAYER_PARAMS: dict[str, tuple[str, int | None]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.o_proj": ("self_attn.o_proj", None),
    "self_attn.q_norm": ("self_attn.q_norm", None),
    "self_attn.k_norm": ("self_attn.k_norm", None),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", None),
    "input_layernorm": ("input_layernorm", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "lm_head.weight")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint files: the shards listed by the index, or the single-file checkpoint(s)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc!r})") from None
        files = [model_dir / str(n) for n in names]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: listed in {index.name} but missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found (PyTorch .bin is not supported)")
    return files


def _fused_slices(cfg: ModelConfig, our_name: str) -> tuple[int, ...]:
    if our_name.endswith("qkv_proj"):
        return (cfg.q_size, cfg.kv_size, cfg.kv_size)
    return (cfg.intermediate_size, cfg.intermediate_size)


def load_model(model_dir: Path, ops: Ops, dtype: torch.dtype, device: torch.device,
               max_position: int | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    files = safetensors_files(model_dir)
    model = LlamaForCausalLM(cfg, ops, dtype, device, max_position or cfg.max_position_embeddings)
    params = dict(model.named_parameters())
    # Each parameter counts as loaded once every fused part has been copied in.
    expected_parts = {n: (len(_fused_slices(cfg, n.rsplit(".", 1)[0]))
                          if ("qkv_proj" in n or "gate_up_proj" in n) else 1) for n in params}
    loaded: dict[str, set[int]] = {n: set() for n in params}

    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from None
        with handle as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                target = _map_name(cfg, hf_name)
                if target is None:
                    if not hf_name.endswith(_IGNORED_SUFFIXES):
                        log.warning("%s: ignoring unexpected tensor %s", path.name, hf_name)
                    continue
                our_name, part = target
                if our_name not in params:
                    raise ModelLoadError(
                        f"{path}: tensor {hf_name} does not fit this config ({cfg.num_layers} layers, "
                        f"bias on q/k/v: {cfg.qkv_bias})"
                    )
                try:
                    tensor = f.get_tensor(hf_name)
                except (SafetensorError, RuntimeError, ValueError) as exc:
                    raise ModelLoadError(f"{path}: cannot read tensor {hf_name} ({exc})") from None
                dest = params[our_name].data
                if part is not None:
                    sizes = _fused_slices(cfg, our_name.rsplit(".", 1)[0])
                    start = sum(sizes[:part])
                    dest = dest.narrow(0, start, sizes[part])
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"{path}: tensor {hf_name} has shape {tuple(tensor.shape)}, but config.json "
                        f"implies {tuple(dest.shape)}"
                    )
                if not (tensor.is_floating_point() and torch.isfinite(tensor).all()):
                    raise ModelLoadError(f"{path}: tensor {hf_name} holds non-finite or non-float values")
                dest.copy_(tensor)
                loaded[our_name].add(part or 0)

    missing = [n for n, parts in loaded.items() if len(parts) < expected_parts[n]]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{model_dir}: checkpoint is missing weights for {shown}")
    model.eval()
    model.pack_weights()
    return model, cfg


def _map_name(cfg: ModelConfig, hf_name: str) -> tuple[str, int | None] | None:
    """HF tensor name -> (our parameter name, fused part index or None); None if unknown."""
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens", None
    if hf_name == "model.norm.weight":
        return "norm.weight", None
    if hf_name == "lm_head.weight":
        # Tied checkpoints sometimes still store lm_head; it equals the embedding, so skip it.
        return None if cfg.tie_word_embeddings else ("lm_head", None)
    m = _LAYER_RE.match(hf_name)
    if m is None:
        return None
    index, rest = m.group(1), m.group(2)
    sub, _, kind = rest.rpartition(".")
    if sub not in _LAYER_PARAMS or kind not in ("weight", "bias"):
        return None
    our_sub, part = _LAYER_PARAMS[sub]
    return f"layers.{index}.{our_sub}.{kind}", part
