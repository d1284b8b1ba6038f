"""Compiler tests: kernels go to a per-session temporary cache (compiled once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmkit.framework import compiler
from llmkit.framework.compiler import tune


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kernels")
    compiler.set_cache_dir(path)
    tune.forget()
    yield path
    compiler.set_cache_dir(None)
    tune.forget()


needs_cc = pytest.mark.skipif(not compiler.available(), reason="no working C compiler on this machine")
