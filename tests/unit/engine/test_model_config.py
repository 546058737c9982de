"""ModelConfig parsing of HF config.json, and our rope frequencies against transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sluice.workers.model.config import ModelConfig, ModelLoadError
from sluice.workers.model.llama import rope_inv_freq

pytestmark = pytest.mark.unit

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def test_llama3_rope_from_transformers_4_layout() -> None:
    cfg = ModelConfig.from_dict({**BASE, "rope_scaling": LLAMA3_ROPE, "eos_token_id": [5, 6]})
    assert (cfg.family, cfg.head_dim, cfg.num_kv_heads) == ("llama", 16, 2)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 8.0
    assert cfg.eos_token_ids == (5, 6) and not cfg.qkv_bias and not cfg.tie_word_embeddings


def test_transformers_5_rope_parameters_layout() -> None:
    raw = {**BASE, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 1234.0}}
    del raw["rope_theta"]
    assert ModelConfig.from_dict(raw).rope.theta == 1234.0


def test_family_specifics_qwen2_bias_mistral_window_qwen3_qk_norm() -> None:
    qwen = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 128})
    assert mistral.max_position_embeddings == 128 and not mistral.qkv_bias
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32 and not qwen.qk_norm


def test_rope_inv_freq_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"},
                            rope_scaling=LLAMA3_ROPE)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(ModelConfig.from_dict({**BASE, "rope_scaling": LLAMA3_ROPE}).rope, 16)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("patch", "message"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture GPT2LMHeadModel"),
    ({"hidden_size": "big"}, "'hidden_size' must be int"),
    ({"num_key_value_heads": 3}, "multiple of"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_configs_raise_model_load_error(patch: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict({**BASE, **patch})


def test_missing_field_and_bad_json_name_the_file(tmp_path: Path) -> None:
    raw = dict(BASE)
    del raw["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"config\.json: required field 'vocab_size'"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")
