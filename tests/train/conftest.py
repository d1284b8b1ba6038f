"""Fixtures for training tests: caches go to a per-session temporary directory, never ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmkit.models.llama.tokenizer import LlamaTokenizer
from llmkit.train.corpus import builtin_tokenizer


@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llmkit-cache")


@pytest.fixture(autouse=True)
def _llmkit_cache_dir(session_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(session_cache_dir))


@pytest.fixture(scope="session")
def builtin_tok(session_cache_dir: Path) -> LlamaTokenizer:
    """The 4096-piece built-in tokenizer, trained once per session (~0.5 s)."""
    return builtin_tokenizer(4096, cache_dir=session_cache_dir)
