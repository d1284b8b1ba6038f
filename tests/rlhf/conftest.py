"""Fixtures for RLHF tests: a small random Llama with the built-in tokenizer, as a checkpoint
directory (what ``model.init_from`` points at)."""

from __future__ import annotations

from pathlib import Path

import pytest

import llmkit.framework as lf
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM


def small_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    lf.seed(seed)
    cfg = LlamaConfig.from_preset("tiny", **{"vocab_size": 4096, "num_hidden_layers": 2, **overrides})
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory, tok) -> Path:
    """A checkpoint directory: config.json, model.safetensors, tokenizer.model."""
    path = tmp_path_factory.mktemp("policy") / "model"
    small_model().save_pretrained(path)
    tok.save_pretrained(path)
    return path
