"""Fixtures for engine tests: a tiny random Llama (the built-in tokenizer's vocabulary), caches in tmp."""

from __future__ import annotations

import pytest

import llmkit.framework as lf
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    lf.seed(seed)
    cfg = LlamaConfig.from_preset("tiny", **{"vocab_size": 4096, "num_hidden_layers": 2, **overrides})
    model = LlamaForCausalLM(cfg)
    model.eval()
    return model


@pytest.fixture(scope="session")
def model() -> LlamaForCausalLM:
    """Random weights: 2 layers, width 128, 4 query / 2 kv heads, 512 positions."""
    return tiny_model()
