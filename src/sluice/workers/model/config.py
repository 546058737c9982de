"""ModelConfig: the architecture facts our model code needs, read from a local HF `config.json`.

Parsed from the JSON directly (not through AutoConfig) so every problem can be reported as a
`ModelLoadError` naming the file and the field. Supports Llama 2/3 (GQA, llama3/linear rope
scaling, tied or untied embeddings), Mistral, Qwen2/2.5 (bias on q/k/v) and Qwen3 (RMSNorm on
each head of q and k).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# HF architecture name -> our model family. All three share the Llama block layout.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    family: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama and Qwen3 when attention_bias
    o_bias: bool  # Llama/Qwen3 attention_bias also biases o_proj
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before rotary
    mlp_bias: bool
    torch_dtype: str  # dtype the checkpoint was saved in ("float32", "bfloat16", ...)
    eos_token_ids: tuple[int, ...]  # from config.json; generation_config.json may add more

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"model directory {model_dir} does not exist or is not a directory")
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing; a Hugging Face model directory needs config.json")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: expected a JSON object at the top level")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        def field(name: str, kind: type, default: Any = ...) -> Any:
            value = raw.get(name, default)
            if value is ...:
                raise ModelLoadError(f"{source}: required field {name!r} is missing")
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ModelLoadError(f"{source}: field {name!r} must be {kind.__name__}, got {value!r}")
            return value

        architectures = raw.get("architectures") or []
        if not isinstance(architectures, list):
            raise ModelLoadError(f"{source}: field 'architectures' must be a list")
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not architectures:
            arch = _MODEL_TYPE_TO_ARCH.get(str(raw.get("model_type")))
        if arch is None:
            named = ", ".join(map(str, architectures)) or f"model_type {raw.get('model_type')!r}"
            raise ModelLoadError(
                f"{source}: unsupported architecture {named}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        family = SUPPORTED_ARCHITECTURES[arch]

        hidden = field("hidden_size", int)
        num_heads = field("num_attention_heads", int)
        num_kv_heads = field("num_key_value_heads", int, num_heads)
        if min(hidden, num_heads, num_kv_heads) <= 0:
            raise ModelLoadError(f"{source}: hidden_size and head counts must be positive")
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = raw.get("head_dim") or hidden // num_heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim must be a positive even integer, got {head_dim!r}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        attention_bias = bool(raw.get("attention_bias", False))
        max_pos = field("max_position_embeddings", int, 4096)
        sliding = raw.get("sliding_window")
        if family == "mistral" and isinstance(sliding, int) and sliding > 0:
            # We run full attention; within the window it equals sliding-window attention.
            max_pos = min(max_pos, sliding)
        if family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
            raise ModelLoadError(f"{source}: Qwen with use_sliding_window=true is not supported")
        return cls(
            architecture=arch,
            family=family,
            vocab_size=field("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=field("intermediate_size", int),
            num_layers=field("num_hidden_layers", int),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=field("rms_norm_eps", float, 1e-6),
            rope=_parse_rope(raw, source),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family in ("llama", "qwen3") and attention_bias,
            qk_norm=family == "qwen3",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


def _parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta included); 4.x writes rope_theta + rope_scaling.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{source}: rope_parameters / rope_scaling must be an object")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: "
            + ", ".join(_SUPPORTED_ROPE_TYPES)
        )
    try:
        rope = RopeConfig(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )
    except (TypeError, ValueError):
        raise ModelLoadError(f"{source}: rope parameters must be numbers, got {params!r}") from None
    if not (math.isfinite(rope.theta) and rope.theta > 0 and rope.factor > 0):
        raise ModelLoadError(f"{source}: rope_theta and rope factor must be positive, got {params!r}")
    return rope
