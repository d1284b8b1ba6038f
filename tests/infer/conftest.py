"""Fixtures for engine tests: a tiny random Llama (the built-in tokenizer's vocabulary), caches in tmp."""

from __future__ import annotations

from pathlib import Path

import pytest

import llmkit.framework as lf
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.tokenizer import LlamaTokenizer
from llmkit.train.corpus import builtin_tokenizer


@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llmkit-cache")


@pytest.fixture(autouse=True)
def _llmkit_cache_dir(session_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(session_cache_dir))


@pytest.fixture(scope="session")
def tok(session_cache_dir: Path) -> LlamaTokenizer:
    """The 4096-piece built-in tokenizer (trained once per session, cached)."""
    return builtin_tokenizer(4096, cache_dir=session_cache_dir)


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
