"""A model directory's tokenizer, loaded alike by the gateway and the workers (torch-free).

The directories sluice makes (`sluice model fetch` and `import`, the demo model) declare transformers'
generic fast tokenizer over tokenizer.json (`tokenizer_class: PreTrainedTokenizerFast`). That class
is loaded directly: `AutoTokenizer` would first load the model's configuration class, whose module
imports torch, about 3 s of CPU at each gateway start for a process that needs no torch. Any other
declared class, or none, goes through `AutoTokenizer`, which picks it as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sluice.workers.model.config import ModelLoadError

# The generic fast tokenizer's names (transformers 5 calls the class TokenizersBackend).
GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def declared_class(model_dir: Path) -> str | None:
    """`tokenizer_class` from tokenizer_config.json, or None when the file or the key is absent."""
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        declared = json.loads(path.read_text(encoding="utf-8")).get("tokenizer_class")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    return declared if isinstance(declared, str) else None


def load_tokenizer(model_dir: Path) -> Any:  # a transformers PreTrainedTokenizerBase
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer.model").is_file():
        raise ModelLoadError(f"{model_dir}: missing tokenizer.json")
    generic = (model_dir / "tokenizer.json").is_file() and declared_class(model_dir) in GENERIC_CLASSES
    try:
        if generic:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for a broken tokenizer directory
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
