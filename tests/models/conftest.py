"""Fixtures for model tests: caches go to a per-session temporary directory, never ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llmkit-cache")


@pytest.fixture(autouse=True)
def _llmkit_cache_dir(session_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(session_cache_dir))
