"""A tiny, deterministic Llama-architecture demo model in Hugging Face layout.

4 layers, hidden 256, 8 query heads / 2 KV heads, seeded random weights (so it writes
gibberish), and a byte-level BPE tokenizer trained with `tokenizers` on `demo_corpus.txt`
(shipped with sluice, written by us). Tests and demos build it in a few seconds:
`make_demo_model(path)` or `sluice model make-demo DIR`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = Path(__file__).with_name("demo_corpus.txt")
BOS, EOS, IM_START = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 256, 4, 8, 2, 768
MAX_POSITIONS = 4096
TARGET_VOCAB = 512


def train_demo_tokenizer() -> Tokenizer:
    """The demo byte-level BPE tokenizer, trained on demo_corpus.txt (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    return tokenizer


def _random_weights(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors; std 1/sqrt(fan_in) keeps activations and logits O(1)."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN // HEADS

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)

    tensors = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN, generator=gen),
               "model.norm.weight": torch.ones(HIDDEN),
               "lm_head.weight": linear(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = linear(HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = linear(KV_HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = linear(KV_HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = linear(HIDDEN, HEADS * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = linear(HIDDEN, INTERMEDIATE)
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    return {k: v.contiguous() for k, v in tensors.items()}


def make_demo_model(path: Path, *, seed: int = 0) -> Path:
    """Writes the demo model into `path` (created if needed) and returns `path`.

    Same seed -> byte-identical files. Layout: config.json, generation_config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json, special_tokens_map.json.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_demo_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    bos_id, eos_id, im_end_id = (tokenizer.token_to_id(t) for t in (BOS, EOS, IM_END))

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, im_end_id],
        "torch_dtype": "float32",
    }
    generation_config = {"bos_token_id": bos_id, "eos_token_id": [eos_id, im_end_id],
                         "do_sample": False}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": EOS,
        "add_bos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {"bos_token": BOS, "eos_token": IM_END, "pad_token": EOS}
    for name, obj in (("config.json", config), ("generation_config.json", generation_config),
                      ("tokenizer_config.json", tokenizer_config),
                      ("special_tokens_map.json", special_tokens_map)):
        (path / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file(_random_weights(vocab, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
