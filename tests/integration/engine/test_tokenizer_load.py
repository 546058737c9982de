"""The tokenizer of a model directory (sluice.workers.model.tokenizer): the generic fast class that
sluice's own directories declare is loaded directly, and is the tokenizer AutoTokenizer gives; any
other class goes through AutoTokenizer; a gateway loads its tokenizers without importing torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from sluice.workers.model import ModelLoadError
from sluice.workers.model.tokenizer import declared_class, load_tokenizer

pytestmark = pytest.mark.integration

TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnew lines", "ünïcødé ✓ 日本語",
         "<|im_start|>user\nhi<|im_end|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a sluice?"},
        {"role": "assistant", "content": "A gate."}, {"role": "user", "content": "And a gateway?"}]


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
    assert a.special_tokens_map == b.special_tokens_map and a.all_special_ids == b.all_special_ids
    added = [{i: str(t) for i, t in tok.added_tokens_decoder.items()} for tok in (a, b)]
    assert added[0] == added[1]
    assert a.chat_template == b.chat_template and a.model_max_length == b.model_max_length
    for text in TEXTS:
        for special in (True, False):
            assert a.encode(text, add_special_tokens=special) == b.encode(text, add_special_tokens=special)
        ids = b.encode(text)
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    if b.chat_template:
        assert (a.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
                == b.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False))


@pytest.mark.parametrize("which", ["demo", "real"])
def test_the_generic_class_loads_as_auto_tokenizer_would(which: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue("demo_model_dir" if which == "demo" else "real_model_dir")
    assert declared_class(model_dir) == "PreTrainedTokenizerFast"
    _same(load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir)))


def test_another_declared_class_goes_through_auto_tokenizer(tmp_path: Path, demo_model_dir: Path) -> None:
    model_dir = Path(shutil.copytree(demo_model_dir, tmp_path / "gpt2-declared"))
    path = model_dir / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"tokenizer_class": "GPT2Tokenizer"}))
    _same(load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir)))


def test_a_broken_tokenizer_config_is_one_clear_error(tmp_path: Path, demo_model_dir: Path) -> None:
    model_dir = Path(shutil.copytree(demo_model_dir, tmp_path / "broken"))
    (model_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: not valid JSON"):
        load_tokenizer(model_dir)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (model_dir / "tokenizer.json").write_text("[]")
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(model_dir)


def test_a_gateway_loads_its_tokenizer_without_torch(demo_model_dir: Path) -> None:
    code = ("import sys; import sluice.gateway.app; from sluice.gateway.generation.tokenization import ModelTokenizer; "
            "t = ModelTokenizer.load('demo', sys.argv[1]); assert t.encode('hello'); "
            "print(sorted(m for m in ('torch', 'triton', 'safetensors') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(demo_model_dir)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
