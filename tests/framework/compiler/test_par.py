"""The kernels' thread pool (``compiler/par.py``): every chunk of every loop runs exactly once, on
a worker index below the loop's thread count, whoever claims it; two callers at once, loops opened
inside a chunk, more chunks than one claim word counts, and a forked child all still do.

The probe kernel below counts, per chunk, how often it ran (an atomic add) and which worker ran it
last; the counts expected are worked out here in numpy from the loop sizes alone.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import jit
from llmkit.framework.compiler import available, par, runtime
from llmkit.framework.compiler.native import build_c

pytestmark = pytest.mark.skipif(not available(), reason="no working C compiler")

PROBE = (
    "#include <stdatomic.h>\n"
    + r"""
typedef struct {
  _Atomic int64_t *hits;
  int64_t *who, spin, nested, threads;
} KERNEL_FN_ctx;

static void KERNEL_FN_leaf(void *arg, int64_t i, int64_t worker) {
  KERNEL_FN_ctx *c = (KERNEL_FN_ctx *)arg;
  atomic_fetch_add(&c->hits[i], 1);
  c->who[i] = worker;
  for (volatile int64_t k = 0; k < c->spin; k++) {
  }
}

/* a chunk that opens a loop of its own over chunks 0 .. i */
static void KERNEL_FN_outer(void *arg, int64_t i, int64_t worker) {
  KERNEL_FN_ctx *c = (KERNEL_FN_ctx *)arg;
  (void)worker;
  llmkit_par_run(i + 1, c->threads, KERNEL_FN_leaf, c);
}

/* bufs: hits [n] int64, who [n] int64, status. sizes: n, loops, spin, nested.
   Loop j (of `loops`) covers chunks 0 .. n - (j * 7919) % n - 1 (nested: 0 .. n-1, whose chunk i
   opens a loop over 0 .. i). */
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  KERNEL_FN_ctx c = {(_Atomic int64_t *)bufs[0], (int64_t *)bufs[1], sizes[2], sizes[3], nthreads};
  for (int64_t j = 0; j < sizes[1]; j++) {
    if (sizes[3]) llmkit_par_run(sizes[0], nthreads, KERNEL_FN_outer, &c);
    else llmkit_par_run(sizes[0] - (j * 7919) % sizes[0], nthreads, KERNEL_FN_leaf, &c);
  }
}
"""
)


@pytest.fixture(autouse=True)
def helpers_spin():
    """Helpers stay awake between loops (as in inference processes), so that they do take chunks
    of these short loops however slowly the machine wakes threads."""
    before = par._spin_ns
    par.set_spin(200_000)
    yield
    par.set_spin(before)


def run(n: int, loops: int, threads: int, spin: int = 0, nested: bool = False) -> tuple[np.ndarray, ...]:
    fn = build_c(PROBE)
    hits = np.zeros(n, np.int64)
    who = np.full(n, -1, np.int64)
    status = np.zeros(3, np.int64)
    bufs = (ctypes.c_void_p * 3)(hits.ctypes.data, who.ctypes.data, status.ctypes.data)
    fn(bufs, (ctypes.c_int64 * 4)(n, loops, spin, int(nested)), threads)
    return hits, who


def expected(n: int, loops: int) -> np.ndarray:
    sizes = n - (np.arange(loops, dtype=np.int64) * 7919) % n
    return (np.arange(n)[:, None] < sizes[None, :]).sum(axis=1)


def a_helper_takes_part(threads: int, seconds: float = 30.0) -> bool:
    """Whether a helper runs some chunk of these loops within ``seconds``: on a loaded machine the
    caller may well do every chunk of a loop itself (the point of the pool), so keep trying; every
    try's counts must be right."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        hits, who = run(97, 300, threads, spin=2000)
        if not np.array_equal(hits, expected(97, 300)) or who.max() >= threads:
            return False
        if who.max() >= 1:
            return True
    return False


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_every_chunk_of_every_loop_runs_once_on_a_worker_below_the_thread_count(threads):
    n, loops = 97, 3000
    hits, who = run(n, loops, threads, spin=200)
    np.testing.assert_array_equal(hits, expected(n, loops))
    assert who[hits > 0].min() >= 0 and who.max() < threads
    if threads > 1:
        assert a_helper_takes_part(threads)
        assert par.helpers() >= 1


def test_single_chunk_loops_and_one_thread_run_on_the_caller():
    hits, who = run(1, 50, 4)
    assert hits.tolist() == [50] and who.tolist() == [0]
    hits, who = run(64, 10, 1)
    np.testing.assert_array_equal(hits, expected(64, 10))
    assert set(who[hits > 0].tolist()) == {0}


def test_more_chunks_than_one_claim_word_counts_are_claimed_in_groups():
    n = (1 << 19) + 12345  # past the 19-bit claim counter
    hits, who = run(n, 1, 2)
    assert hits.min() == 1 and hits.max() == 1
    assert who.max() < 2


def test_a_chunk_that_opens_a_loop_runs_it_on_its_own_thread():
    n = 40
    hits, _ = run(n, 3, 2, nested=True)
    # loop over 0..n-1, chunk i opens 0..i: chunk k runs (n - k) times per outer loop
    np.testing.assert_array_equal(hits, 3 * (n - np.arange(n)))


def test_two_callers_at_once_both_get_every_chunk():
    results: dict[int, tuple] = {}

    def caller(k: int) -> None:
        results[k] = run(61 + k, 1500, 2, spin=100)

    ts = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for k, (hits, who) in results.items():
        np.testing.assert_array_equal(hits, expected(61 + k, 1500))
        assert who.max() < 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_starts_its_own_helpers():
    run(50, 100, 2)  # helpers running in the parent
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a multi-threaded process
        pid = os.fork()
    if pid == 0:  # the child: its helpers did not come along; a parallel loop must still finish
        try:
            hits, _ = run(50, 500, 2, spin=200)
            ok = np.array_equal(hits, expected(50, 500)) and a_helper_takes_part(2) and par.helpers() >= 1
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


_NO_POOL = """
import json, os, warnings
import numpy as np
from llmkit.framework.compiler import par
par.SOURCE = "this is not C"  # the pool fails to compile
import llmkit.framework as lf
from llmkit.framework import jit
from llmkit.framework.compiler import runtime
from llmkit.framework.compiler.native import build_c
from llmkit.framework.opspec import table
x = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
w = np.linspace(0.5, 1.5, 1024, dtype=np.float32)
threads = len(os.listdir("/proc/self/task"))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    f = jit.to_static(lambda x, w: lf.ops.rms_norm(x, w, eps=1e-6))
    y = [f(lf.tensor(x), lf.tensor(w)).numpy() for _ in range(3)][-1]
    linear = build_c(table()["tiled_linear"].native.source)
x64 = x.astype(np.float64)
want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * w
print(json.dumps({
    "said": [str(c.message).splitlines()[0] for c in caught],
    "kinds": sorted({type(c.message).__name__ for c in caught}),
    "compiled": len(runtime._KERNELS), "native": linear is not None,
    "new_threads": len(os.listdir("/proc/self/task")) - threads,
    "err": float(np.abs(y - want).max() / np.abs(want).max()),
}))
"""


def test_without_the_pool_kernels_run_compiled_on_the_calling_thread_with_one_warning(tmp_path):
    env = {
        **os.environ,
        "LLMKIT_KERNEL_CACHE": str(tmp_path),
        "LLMKIT_CINN_TUNE": "0",
        "LLMKIT_CINN_THREADS": "2",
    }
    r = subprocess.run([sys.executable, "-c", _NO_POOL], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["said"] == ["cinn: the kernels' thread pool failed to compile; kernels run on one thread."], (
        got
    )
    assert got["kinds"] == ["FallbackWarning"]
    # the group got its kernel and the hand-written kernels load: both run their loops here
    assert got["compiled"] >= 1 and got["native"] and got["new_threads"] == 0, got
    assert got["err"] < 1e-6, got


def test_a_generated_kernel_runs_its_parallel_loop_on_the_pool():
    """Two threads for a compiled RMSNorm: the kernel hands its row loop to the pool once per call
    (the pool's counters), and a helper takes part in some call (the caller may well do every
    chunk of one call itself on a loaded machine: that is the point of the pool)."""
    x = np.random.default_rng(0).standard_normal((257, 1001)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 1001, dtype=np.float32)
    f = jit.to_static(lambda x, w: lf.ops.rms_norm(x, w, eps=1e-6))
    f(lf.tensor(x), lf.tensor(w))  # compiled, and planned for these shapes
    key = ((x.shape, x.strides), (w.shape, w.strides))
    (plan,) = [k._plans[key] for k in list(runtime._KERNELS.values()) if key in k._plans]
    fn, sizes = plan[1], plan[2]
    y = np.empty_like(x)
    bufs = (ctypes.c_void_p * 3)(x.ctypes.data, w.ctypes.data, y.ctypes.data)
    loops, helped = par.counts()
    deadline = time.monotonic() + 30
    calls = 0
    while True:
        fn(bufs, sizes, 2)
        calls += 1
        if par.counts()[1] > helped or time.monotonic() > deadline:
            break
    assert par.counts()[0] - loops == calls
    assert par.counts()[1] > helped
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(y, x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * w, rtol=1e-5)
