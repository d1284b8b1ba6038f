"""Llama: config, model, Hugging Face checkpoint io and sentencepiece tokenizer."""

from . import sharding  # noqa: F401  (registers the built-in plan "llama")
from .config import PRESETS, LlamaConfig
from .model import CausalLMOutput, KVCache, LlamaForCausalLM, LlamaModel
from .tokenizer import LlamaTokenizer

__all__ = [
    "PRESETS",
    "CausalLMOutput",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "LlamaTokenizer",
]
