"""`sluice generate` and `sluice model make-demo` through the real command line."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.cli import main

pytestmark = pytest.mark.integration


def test_make_demo_is_deterministic(tmp_path: Path, demo_model_dir: Path) -> None:
    assert main(["model", "make-demo", str(tmp_path / "demo")]) == 0

    def digest(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    assert digest(tmp_path / "demo") == digest(demo_model_dir)
    config = json.loads((tmp_path / "demo" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    tok_config = json.loads((tmp_path / "demo" / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_config and tok_config["eos_token"]


def test_generate_jsonl_with_garbage_lines(tmp_path: Path, demo_model_dir: Path) -> None:
    lines = [
        json.dumps({"id": "a", "prompt": "The river", "max_tokens": 5, "temperature": 0, "ignore_eos": True}),
        "{not json",
        json.dumps({"id": "b", "prompt_token_ids": [20, 30, 40], "max_tokens": 3, "temperature": 0,
                    "ignore_eos": True, "logprobs": True}),
        json.dumps({"id": "c", "prompt": ""}),
        json.dumps({"id": "d", "prompt": "x", "max_tokens": 0}),
        json.dumps({"id": "e", "prompt": "x", "max_tokens": "many"}),
        json.dumps({"id": "f", "prompt_token_ids": [20] * 300}),
        json.dumps({"id": "g", "prompt": 5}),
        json.dumps({"id": "h", "prompt": "The keeper", "max_tokens": 4, "temperature": 0.8, "seed": 3,
                    "ignore_eos": True}),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "generate", "--model", str(demo_model_dir),
         "--input", str(inp), "--output", str(out),
         "--max-model-len", "256", "--num-kv-blocks", "64", "--max-prefill-chunk", "24", "--threads", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "line-2", "b", "c", "d", "e", "f", "g", "h"]
    by_id = {r["id"]: r for r in records}
    for ok, n in (("a", 5), ("b", 3), ("h", 4)):
        assert "error" not in by_id[ok]
        assert len(by_id[ok]["token_ids"]) == n and by_id[ok]["finish_reason"] == "length"
        assert by_id[ok]["usage"]["completion_tokens"] == n
    assert len(by_id["b"]["logprobs"]) == 3 and by_id["b"]["usage"]["prompt_tokens"] == 3
    assert "JSON" in by_id["line-2"]["error"]
    assert "empty" in by_id["c"]["error"]
    assert "max_tokens" in by_id["d"]["error"]
    assert "max_tokens" in by_id["e"]["error"]
    assert "prompt tokens" in by_id["f"]["error"]
    assert "'prompt' must be a string" in by_id["g"]["error"]
    assert "3 completed, 6 rejected" in proc.stderr


def test_generate_missing_model_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text("{}\n")
    code = main(["generate", "--model", str(tmp_path / "nope"), "--input", str(inp),
                 "--output", str(tmp_path / "o.jsonl")])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err
