"""BLAS process settings (``framework/blas.py``): thread count and OpenBLAS's spin timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
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


def _blocks_on_this_thread(a, b, rows):
    """The reference schedule: every block on the calling thread, OpenBLAS on one thread."""
    out = np.empty((a.shape[0], b.shape[1]), a.dtype)
    with blas.blas_threads(1):
        for i in range(0, a.shape[0], rows):
            np.matmul(a[i : i + rows], b, out=out[i : i + rows])
    return out


@pytest.mark.parametrize("schedule", ["alone", "helper_first", "random"])
def test_matmul_rows_bits_do_not_depend_on_which_thread_computes_a_block(schedule, monkeypatch):
    """The schedule follows the machine's load; the bits must not (resumed runs equal whole ones)."""
    rng = np.random.default_rng(1)
    y = rng.standard_normal((257, 130)).astype(np.float32)  # odd sizes: OpenBLAS's tail kernels
    x = rng.standard_normal((257, 700)).astype(np.float32).T  # a weight gradient's g.T
    want = _blocks_on_this_thread(x, y, 96)
    claims = {True: 0, False: 0}
    delay = np.random.default_rng(2)

    def hook(helper):
        claims[helper] += 1
        if schedule == "helper_first" and not helper:
            time.sleep(0.02)  # the caller arrives late at every block: helpers compute most
        elif schedule == "random":
            time.sleep(delay.uniform(0, 0.004))

    monkeypatch.setattr(blas, "_claim_hook", hook)
    threads = 1 if schedule == "alone" else 3
    got = blas.matmul_rows(x, y, np.empty((700, 130), np.float32), threads, 96)
    assert got.tobytes() == want.tobytes()
    if schedule == "helper_first":
        assert claims[True] >= 3  # helpers did claim blocks (a helper's last look finds none left)


def test_matmul_rows_on_two_threads_at_once_restores_the_thread_count(monkeypatch):
    """Two callers overlapping (simulated ranks): the one that ends first must not restore the count
    while the other runs, nor the other restore the 1 it found (the process would stay on one thread)."""
    before = blas.get_blas_threads()
    if before is None or before < 2:
        pytest.skip("needs OpenBLAS on several threads")
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def hook(helper):
        name = threading.current_thread().name
        if name == "A" and not a_in.is_set():
            a_in.set()
            assert b_in.wait(5)
        elif name == "B" and not b_in.is_set():
            b_in.set()
            assert a_out.wait(5)
            seen["after_a"] = blas.get_blas_threads()  # B still running: one thread

    monkeypatch.setattr(blas, "_claim_hook", hook)
    x, y = np.ones((64, 8), np.float32), np.ones((8, 4), np.float32)

    def run_a():
        blas.matmul_rows(x, y, np.empty((64, 4), np.float32), 1, 16)
        a_out.set()

    def run_b():
        assert a_in.wait(5)
        blas.matmul_rows(x, y, np.empty((64, 4), np.float32), 1, 16)

    ts = [threading.Thread(target=run_a, name="A"), threading.Thread(target=run_b, name="B")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert seen["after_a"] == 1 and blas.get_blas_threads() == before
