"""The BLAS thread count of this process (OpenBLAS as bundled with numpy).

Small decode matrices gain nothing from a second BLAS thread, and on a machine shared with other
work OpenBLAS's spinning threads can slow a step down several times over; the server runs with one
BLAS thread unless told otherwise. The count is process-wide: an in-process engine leaves it alone.

How long idle OpenBLAS threads spin before sleeping can only be set before numpy loads OpenBLAS
(``OPENBLAS_THREAD_TIMEOUT``, 2**n cycles): ``import llmkit`` sets 18 when it comes first and the
variable is unset (see ``llmkit/__init__.py``); :func:`blas_thread_timeout` reports what applies.

:func:`matmul_rows` runs one product on several threads without OpenBLAS's own: blocks of output
rows, each a single-threaded BLAS call, claimed by whichever thread is free (compiled training steps'
products, ``compiler/native/products.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads")


@functools.cache
def _lib() -> ctypes.CDLL | None:
    import numpy  # noqa: F401  (loads the BLAS library numpy links)

    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line})
    except OSError:
        return None
    for p in paths:
        try:
            lib = ctypes.CDLL(p)
        except OSError:
            continue
        if any(hasattr(lib, s) for s in _SETTERS):
            return lib
    return None


def _fn(names: tuple[str, ...]):
    lib = _lib()
    if lib is None:
        return None
    for n in names:
        if hasattr(lib, n):
            return getattr(lib, n)
    return None


def blas_thread_timeout() -> int | None:
    """``OPENBLAS_THREAD_TIMEOUT`` of this process, or None (OpenBLAS's default); it applies when it
    was set before numpy loaded OpenBLAS."""
    v = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
    return int(v) if v and v.strip().isdigit() else None


def get_blas_threads() -> int | None:
    """OpenBLAS's current thread count, or None when numpy does not use OpenBLAS."""
    fn = _fn(_GETTERS)
    return None if fn is None else int(fn())


def set_blas_threads(n: int) -> bool:
    """Use ``n`` BLAS threads from now on; False when the BLAS is not OpenBLAS (nothing changes)."""
    if n < 1:
        raise ValueError(f"BLAS threads must be >= 1, got {n}")
    fn = _fn(_SETTERS)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int]
    fn(int(n))
    return True


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """``n`` BLAS threads inside the block (or the decorated function), the count before restored
    after. OpenBLAS's float32 products may round a product's elements differently with the thread
    count (the work split, hence the kernel that computes an element, changes), so work whose bits
    must not depend on how many processes share a machine runs under a fixed count."""
    before = get_blas_threads()
    set_blas_threads(n)
    try:
        yield
    finally:
        if before is not None:
            set_blas_threads(before)


_pool: tuple[int, ThreadPoolExecutor] | None = None  # (helpers, the pool)
_pool_lock = threading.Lock()
_single: list[int | None] = [0, None]  # matmul_rows calls in flight, the BLAS thread count before the first
_claim_hook: Any = None  # tests: called as hook(helper) before every claim, to force other schedules


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool
    _pool = None
    _single[:] = [0, None]


os.register_at_fork(after_in_child=_forget_pool)


def _helpers(n: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] < n:
            _pool = (n, ThreadPoolExecutor(n, thread_name_prefix="llmkit-blas"))
        return _pool[1]


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    """OpenBLAS on one thread while any ``matmul_rows`` runs: the first call in sets it, the last one
    out restores the count from before the first. Counted, so that calls on several Python threads
    at once (simulated ranks) never restore each other's 1, which would leave the process on one
    thread and change the rounding of every later product."""
    with _pool_lock:
        if _single[0] == 0:
            _single[1] = get_blas_threads()
            set_blas_threads(1)
        _single[0] += 1
    try:
        yield
    finally:
        with _pool_lock:
            _single[0] -= 1
            if _single[0] == 0 and _single[1] is not None:
                set_blas_threads(_single[1])


def matmul_rows(a: Any, b: Any, out: Any, threads: int, rows: int) -> Any:
    """``out[:] = a @ b`` (2D numpy arrays; ``a`` may be a transposed view): blocks of ``rows`` rows
    of ``out``, each one single-threaded BLAS call, claimed one at a time by this thread and
    ``threads - 1`` helpers. OpenBLAS's threads split a product into pieces that wait for each
    other at every block of the reduction, so a thread the OS sets aside (a shared machine) holds
    the others up many times per product; here a block is the only unit, and this thread waits only
    for blocks a helper claimed and has not finished (a helper that starts late finds none left).
    Which thread computes a block varies with the machine's load; a block's values do not (the same
    single-threaded call on the same rows: ``tests/framework/test_blas.py`` forces other schedules
    and compares the bits). OpenBLAS runs on one thread meanwhile (process-wide; restored after)."""
    import numpy as np

    n = out.shape[0]
    cond = threading.Condition()
    state: dict[str, Any] = {"next": 0, "busy": 0, "error": None}

    def work(helper: bool) -> None:
        while True:
            if _claim_hook is not None:
                _claim_hook(helper)
            with cond:
                i = state["next"]
                if i >= n:
                    return
                state["next"] = i + rows
                state["busy"] += helper
            try:
                np.matmul(a[i : i + rows], b, out=out[i : i + rows])
            except BaseException as e:  # raised by the caller, below
                state["error"] = e
                state["next"] = n
            finally:
                if helper:
                    with cond:
                        state["busy"] -= 1
                        cond.notify_all()

    with _one_blas_thread():
        for _ in range(min(threads - 1, -(-n // rows) - 1)):
            _helpers(threads - 1).submit(work, True)
        work(False)
        with cond:
            while state["busy"]:
                cond.wait()
        if state["error"] is not None:
            raise state["error"]
    return out
