"""GGUF file -> a standard Hugging Face model directory that `loader.load_model` serves.

transformers (with the `gguf` package) reads a GGUF checkpoint and dequantizes every tensor to a
plain float tensor; we then save the weights as safetensors and the tokenizer with its chat
template, so the result needs neither `gguf` nor transformers' quantizer to load again. The
directory appears atomically: everything is written into a temporary sibling, then renamed.
Every failure is a `ModelLoadError` naming the file and the problem.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sluice.workers.model.config import ModelConfig, ModelLoadError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# GGUF `general.architecture` values that both transformers' GGUF reader and our model code handle.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16")
# Written beside the model: where it came from, so `sluice model fetch` can tell a finished import.
PROVENANCE_FILE = "sluice_import.json"


def gguf_architecture(gguf_file: Path) -> str:
    """Parses the GGUF header and tensor table; returns `general.architecture` if we support it."""
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise ModelLoadError(f"{gguf_file}: no such file")
    with gguf_file.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{gguf_file}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - a dependency of sluice
        raise ModelLoadError("reading GGUF files needs the `gguf` package (pip install gguf)") from None
    try:
        reader = GGUFReader(str(gguf_file))
    except (ValueError, IndexError, KeyError, OSError, EOFError) as exc:
        # A truncated file fails here: the tensor table points past the end of the data.
        raise ModelLoadError(f"{gguf_file}: truncated or corrupt GGUF file ({exc})") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError(f"{gguf_file}: GGUF metadata has no general.architecture")
    arch = str(field.contents())
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_file}: GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
        )
    if not reader.tensors:
        raise ModelLoadError(f"{gguf_file}: GGUF file holds no tensors")
    return arch


@contextlib.contextmanager
def renamed_into_place(staging: Path, out_dir: Path) -> Iterator[None]:
    """The body fills `staging`; then it is renamed to `out_dir` (which must be absent or empty), or
    removed if the body (or the rename) failed, so `out_dir` appears whole or not at all."""
    try:
        yield
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (the caller checked); rename cannot replace a directory otherwise
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def import_gguf(gguf_file: Path, out_dir: Path, *, dtype: str = "float32") -> Path:
    """Converts `gguf_file` into the new directory `out_dir` (which must not exist or be empty)."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelLoadError(f"{out_dir}: already exists and is not an empty directory; remove it or choose another")
    arch = gguf_architecture(gguf_file)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    with renamed_into_place(tmp, out_dir):
        _convert(gguf_file, tmp, dtype)
        _write_json(tmp / PROVENANCE_FILE, {"gguf_file": gguf_file.name, "gguf_architecture": arch,
                                            "gguf_size_bytes": gguf_file.stat().st_size, "dtype": dtype})
        ModelConfig.from_dir(tmp)  # what sluice's loader will read must parse
        _chmod_like_umask(tmp)
    log.info("imported %s (%s, %s) into %s", gguf_file, arch, dtype, out_dir)
    return out_dir


def _convert(gguf_file: Path, dest: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = str(gguf_file.resolve().parent), gguf_file.name
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32,
                                                     local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a GGUF it cannot map
        raise ModelLoadError(f"{gguf_file}: transformers cannot load this GGUF ({type(exc).__name__}: {exc})") from None
    for param_name, param in model.named_parameters():
        if not param.is_floating_point():  # a tensor the GGUF reader left quantized
            raise ModelLoadError(f"{gguf_file}: tensor {param_name} was not dequantized ({param.dtype})")
    # The weights are plain float tensors now; the GGUF quantizer state only makes save_pretrained
    # refuse ("not serializable") and would make the saved config ask for gguf again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(str(dest))
    _save_tokenizer(tokenizer, dest, gguf_file, int(model.config.max_position_embeddings))


def _save_tokenizer(tokenizer: Any, dest: Path, gguf_file: Path, max_length: int) -> None:
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ModelLoadError(f"{gguf_file}: the GGUF has no chat template (tokenizer.chat_template)")
    tokenizer.save_pretrained(str(dest))
    # One home for the template: tokenizer_config.json (read by every transformers version),
    # not transformers 5's separate chat_template.jinja.
    (dest / "chat_template.jinja").unlink(missing_ok=True)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):  # facts about this load, not about the tokenizer
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length  # the GGUF leaves it "unbounded"
    config["chat_template"] = template
    _write_json(config_path, config)


def _chmod_like_umask(directory: Path) -> None:
    """mkdtemp makes the directory owner-only; give it the modes a plain mkdir would."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
