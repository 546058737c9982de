"""Our Llama-family model code, its config and the HF-directory loader."""

from sluice.workers.model.config import ModelConfig, ModelLoadError
from sluice.workers.model.llama import LlamaForCausalLM
from sluice.workers.model.loader import load_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "ModelLoadError", "load_model"]
