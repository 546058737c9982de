"""Session-scoped model directories for the engine tests: the demo model and two tiny HF models,
and `hf_greedy`, HF transformers' greedy reference that every exactness test compares against.

The tiny models are built with transformers' own config classes and random weights (std 0.1,
so logits are peaked enough that greedy argmax has no near-ties), saved with save_pretrained,
and given the demo model's tokenizer (vocab 512) so the engine can load them. `demo_model_dir`
comes from tests/conftest.py.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# HF references recorded in the repository (`hf_greedy`): the real model's takes minutes to compute.
RECORDED = Path(__file__).resolve().parents[2] / "data" / "hf-greedy"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """These models are tiny: intra-op threads only add waiting, and on a loaded shared machine
    threads that wait for each other make a test tens of times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_common() -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, initializer_range=0.1,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _save_tiny(model: torch.nn.Module, path: Path, demo_dir: Path) -> Path:
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(demo_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    """Llama 3 style: GQA 4/2, llama3 rope scaling, untied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        **_tiny_common(), tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    return _save_tiny(LlamaForCausalLM(config), tmp_path_factory.mktemp("tiny-llama"), demo_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    """Qwen2 style: bias on q/k/v, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    config = Qwen2Config(**_tiny_common(), tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF zero-initialises biases; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.1)
    return _save_tiny(model, tmp_path_factory.mktemp("tiny-qwen2"), demo_model_dir)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    """Mistral: GQA, untied, a sliding window longer than any test sequence."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    config = MistralConfig(**_tiny_common(), tie_word_embeddings=False, sliding_window=200)
    return _save_tiny(MistralForCausalLM(config), tmp_path_factory.mktemp("tiny-mistral"), demo_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    """Qwen3: RMSNorm on each q/k head, explicit head_dim (here wider than hidden / heads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(4)
    config = Qwen3Config(**_tiny_common(), head_dim=32, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # HF initialises norm weights to 1; make the q/k norms matter
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return _save_tiny(model, tmp_path_factory.mktemp("tiny-qwen3"), demo_model_dir)


@dataclass(frozen=True, slots=True)
class Reference:
    """HF `generate`'s greedy continuation of one prompt, with the margin of each choice."""

    token_ids: list[int]
    runner_up_ids: list[int]  # the second-best token at each position
    gaps: list[float]  # top-1 minus top-2 logit at each position (as float32)
    # The TOP_CHOICES best tokens at each position and their logits' distance below the best one
    # (bfloat16 logits tie three or four ways at a multiple of 1/8, where the runner-up alone is
    # not enough to tell a tie from an error); empty in references stored before they were kept.
    top_ids: list[list[int]] = field(default_factory=list)
    top_gaps: list[list[float]] = field(default_factory=list)

    def near_tie(self, position: int, token: int, margin: float) -> bool:
        """Whether `token`, where HF chose another at `position`, is within `margin` of HF's best logit."""
        if self.top_ids:
            return any(t == token and gap < margin
                       for t, gap in zip(self.top_ids[position], self.top_gaps[position], strict=True))
        return token == self.runner_up_ids[position] and self.gaps[position] < margin


HFGreedy = Callable[..., list[Reference]]
TOP_CHOICES = 8


def _hf_generate(model_dir: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 dtype: torch.dtype = torch.float32) -> list[Reference]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    references = []
    with torch.inference_mode():
        for prompt in prompts:  # each prompt alone: no padding
            ids = torch.tensor([list(prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            top = torch.cat(out.logits).float().topk(TOP_CHOICES, dim=-1)  # [new tokens, TOP_CHOICES]
            references.append(Reference(
                token_ids=out.sequences[0, len(prompt):].tolist(),
                runner_up_ids=top.indices[:, 1].tolist(),
                gaps=(top.values[:, 0] - top.values[:, 1]).tolist(),
                top_ids=top.indices.tolist(),
                top_gaps=(top.values[:, :1] - top.values).tolist(),
            ))
    return references


@pytest.fixture(scope="session")
def hf_greedy(shared_cache_dir: Path) -> HFGreedy:
    """(model_dir, prompts, max_new_tokens, persist=False, dtype=torch.float32) -> one Reference
    per prompt (HF's model loaded in `dtype`).

    Computed once per session; with persist=True also stored in the run's shared cache (under a
    file lock), keyed by the model's config and provenance files, the prompts and the installed
    transformers and torch, so xdist workers compute it once between them. A persisted reference
    recorded in the repository (RECORDED, written where SLUICE_TEST_RECORD_HF=1) is read instead
    of computing it: only where those versions are the ones that recorded it (the key holds them),
    so an upgrade computes afresh. A CPU that rounds float32 sums differently moves only logits
    within a near-tie, which the comparisons already allow."""
    import transformers
    from filelock import FileLock

    memo: dict[str, list[Reference]] = {}

    def get(model_dir: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
            persist: bool = False, dtype: torch.dtype = torch.float32) -> list[Reference]:
        versions = f"transformers {transformers.__version__} torch {torch.__version__}"
        identity = [versions if persist else str(model_dir), f"{dtype} top {TOP_CHOICES}"]
        for name in ("config.json", "sluice_import.json"):
            if (model_dir / name).is_file():
                identity.append((model_dir / name).read_text())
        key = hashlib.sha256(json.dumps([identity, [list(p) for p in prompts], max_new_tokens]).encode()).hexdigest()
        if key in memo:
            return memo[key]
        if not persist:
            memo[key] = _hf_generate(model_dir, prompts, max_new_tokens, dtype)
            return memo[key]
        recorded = RECORDED / f"{key[:24]}.json.gz"
        if recorded.is_file():
            memo[key] = [Reference(**r) for r in json.loads(gzip.decompress(recorded.read_bytes()))]
            return memo[key]
        path = shared_cache_dir / f"hf-greedy-{key[:24]}.json"
        with FileLock(str(path) + ".lock"):
            if path.is_file():
                memo[key] = [Reference(**r) for r in json.loads(path.read_text())]
            else:
                memo[key] = _hf_generate(model_dir, prompts, max_new_tokens, dtype)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps([asdict(r) for r in memo[key]]))
                tmp.rename(path)
        if os.environ.get("SLUICE_TEST_RECORD_HF") == "1":
            RECORDED.mkdir(parents=True, exist_ok=True)
            recorded.write_bytes(gzip.compress(path.read_bytes(), mtime=0))
        return memo[key]

    return get
