"""Shared test setup: every run writes its caches (tokenizers, packed tokens, compiled kernels)
under a temporary directory removed at exit, never into the user's ~/.cache; the built-in
tokenizer is trained once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_root = tempfile.mkdtemp(prefix="llmkit-tests-")
atexit.register(shutil.rmtree, _root, ignore_errors=True)
os.environ.setdefault("LLMKIT_CACHE_DIR", os.path.join(_root, "cache"))
os.environ.setdefault("LLMKIT_KERNEL_CACHE", os.path.join(_root, "kernels"))


@pytest.fixture(scope="session")
def session_cache_dir() -> Path:
    """The cache directory of this test session ($LLMKIT_CACHE_DIR)."""
    return Path(os.environ["LLMKIT_CACHE_DIR"])


@pytest.fixture(scope="session")
def builtin_tok(session_cache_dir: Path):
    """The 4096-piece built-in tokenizer (trained once per session, about half a second)."""
    from llmkit.train.corpus import builtin_tokenizer

    return builtin_tokenizer(4096, cache_dir=session_cache_dir)


@pytest.fixture(scope="session")
def tok(builtin_tok):
    return builtin_tok
