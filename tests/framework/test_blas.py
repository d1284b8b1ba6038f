"""BLAS process settings (``framework/blas.py``): thread count and OpenBLAS's spin timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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


@pytest.mark.parametrize("threads,rows", [(2, 16), (3, 48), (2, 1000)])
def test_matmul_rows_equals_the_float64_product_and_restores_the_thread_count(threads, rows):
    rng = np.random.default_rng(0)
    y = rng.standard_normal((75, 33)).astype(np.float32)
    plain = rng.standard_normal((130, 75)).astype(np.float32)  # blocks of rows, a short last one
    transposed = rng.standard_normal((75, 40)).astype(np.float32).T  # a weight gradient's g.T
    before = blas.get_blas_threads()
    for x in (plain, transposed):
        out = blas.matmul_rows(x, y, np.empty((x.shape[0], 33), np.float32), threads, rows)
        np.testing.assert_allclose(out, x.astype(np.float64) @ y.astype(np.float64), rtol=1e-5, atol=1e-4)
    assert blas.get_blas_threads() == before


def test_matmul_rows_raises_what_a_block_raised():
    a, b = np.ones((64, 3), np.float32), np.ones((4, 2), np.float32)  # 3 != 4
    with pytest.raises(ValueError):
        blas.matmul_rows(a, b, np.empty((64, 2), np.float32), 2, 16)
