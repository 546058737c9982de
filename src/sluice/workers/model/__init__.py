"""Our Llama-family model code, its config and the HF-directory loader.

The names below are loaded on first use, not when the package is: it also holds modules without
torch (the config, the known models `sluice model fetch` makes) that a gateway installed without
torch (`sluice[gateway]`) imports to check its settings.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.workers.model.config import ModelConfig, ModelLoadError
    from sluice.workers.model.llama import LlamaForCausalLM
    from sluice.workers.model.loader import load_model

_MODULE_OF = {"ModelConfig": "config", "ModelLoadError": "config", "LlamaForCausalLM": "llama",
              "load_model": "loader"}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = ["LlamaForCausalLM", "ModelConfig", "ModelLoadError", "load_model"]
