"""BLAS process settings (``framework/blas.py``): thread count and OpenBLAS's spin timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmkit.framework import blas

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **env: str) -> str:
    e = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    e.update(env, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
    return done.stdout


def test_importing_llmkit_first_sets_the_openblas_spin_timeout():
    code = "import llmkit, os; import numpy; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    assert _python(code).strip() == "18"


def test_a_timeout_the_user_set_is_kept_and_numpy_first_is_left_alone():
    code = "import llmkit, os; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    assert _python(code, OPENBLAS_THREAD_TIMEOUT="4").strip() == "4"
    late = "import numpy, llmkit, os; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    assert _python(late).strip() == "None"  # too late for OpenBLAS: not pretended


def test_blas_thread_timeout_reads_the_variable(monkeypatch):
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "12")
    assert blas.blas_thread_timeout() == 12
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT")
    assert blas.blas_thread_timeout() is None


def test_set_blas_threads_round_trip_and_rejects_zero():
    before = blas.get_blas_threads()
    if before is None:
        pytest.skip("numpy does not use OpenBLAS here")
    try:
        assert blas.set_blas_threads(1) and blas.get_blas_threads() == 1
    finally:
        blas.set_blas_threads(before)
    with pytest.raises(ValueError, match="BLAS threads must be >= 1"):
        blas.set_blas_threads(0)
