"""Every GEMM of the compiled training step, each timed against OpenBLAS called directly and PyTorch.

The step of ``train_throughput.py --mode static`` (same config, ``--set`` overrides) is compiled and
run once with every ``llm.matmul`` kernel call recorded: operand shapes and strides, transpose
flags, whether an operand is a non-contiguous view numpy would have to copy, how often per step.
Each distinct product is then timed, in alternated rounds (best of ``--reps`` per variant):

- ``ours``: the op's kernel as the compiled program calls it (``np.matmul`` on transposed views,
  a fresh output per call; ``blas.matmul_rows`` when ``LLMKIT_SPLIT_GEMMS=1``);
- ``sgemm``: ``cblas_sgemm`` of numpy's own OpenBLAS through ctypes, with the transpose flags and a
  preallocated output (no copies, no allocation, no numpy dispatch);
- ``rows``: ``blas.matmul_rows`` as ``compiler/native/products.py`` runs it (both cores, each block
  a one-thread BLAS call);
- ``torch``: ``torch.matmul`` into a preallocated output, same process (``--torch``; MKL, with its
  Intel-CPU check answered yes under ``LD_PRELOAD`` as ``train_throughput.py --torch-tuned`` does).

``ours``/``sgemm`` run at 1 and at 2 OpenBLAS threads (``_t1``, ``_t2``; torch at ``--threads``).
``--cpu-time``: the one-thread variants are timed by the thread's CPU time, which a loaded machine
inflates far less than wall time (the 2-thread ones stay wall time: their CPU time counts spinning).
One JSON line per product (microseconds, GFLOP/s of the best), then the step's totals (each
product times its calls per step).

Run:
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/gemm_table.py [--torch] [--cpu-time]
"""

from __future__ import annotations

# isort: off
import _common  # noqa: F401
import llmkit  # noqa: F401

# isort: on
import argparse
import ctypes
import time

import numpy as np
from _common import emit, load_average, machine

from llmkit.framework import blas, opspec
from llmkit.framework.compiler.native import products
from llmkit.train.config import load_config

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def cblas_sgemm():
    """``fn(a, b, out, ta, tb)``: ``out = op(a) @ op(b)`` by numpy's OpenBLAS's cblas_sgemm (C-contiguous
    arrays as stored; ``ta``/``tb`` transpose them), or None where that library has none."""
    lib = blas._lib()
    names = (
        ("scipy_cblas_sgemm64_", ctypes.c_int64),
        ("cblas_sgemm64_", ctypes.c_int64),
        ("cblas_sgemm", ctypes.c_int),
    )
    found = [(getattr(lib, n), i) for n, i in names if lib is not None and hasattr(lib, n)]
    if not found:
        return None
    f, idx = found[0]
    p, c = ctypes.c_void_p, ctypes.c_int
    f.argtypes = [c, c, c, idx, idx, idx, ctypes.c_float, p, idx, p, idx, ctypes.c_float, p, idx]
    f.restype = None

    def sgemm(a, b, out, ta, tb):
        m, n = out.shape
        k = a.shape[0] if ta else a.shape[1]
        f(_ROW_MAJOR, _TRANS if ta else _NO_TRANS, _TRANS if tb else _NO_TRANS, m, n, k, 1.0,
          a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], 0.0, out.ctypes.data, n)  # fmt: skip

    return sgemm


def trace_step(cfg) -> dict[tuple, dict]:
    """The step's products: (x shape, y shape, tx, ty) -> calls per step and operand layouts."""
    from train_throughput import model_config, static_step_fn

    spec = opspec.get("matmul")
    kernel, seen = spec.kernel, {}

    def traced(xp, x, y, transpose_x=False, transpose_y=False, **attrs):
        rec = seen.setdefault((x.shape, y.shape, transpose_x, transpose_y), {"calls": 0})
        rec["calls"] += 1
        rec["contiguous"] = bool(x.flags.c_contiguous and y.flags.c_contiguous)
        return kernel(xp, x, y, transpose_x=transpose_x, transpose_y=transpose_y, **attrs)

    llama = model_config(cfg)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    ids = np.random.default_rng(0).integers(0, llama.vocab_size, (2, b, s))
    object.__setattr__(spec, "kernel", traced)  # before compiling: a group's matmul head binds it then
    try:
        step = static_step_fn(llama, 1e-3, "cinn")
        step(ids[0], ids[1])
        seen.clear()
        step(ids[0], ids[1])
    finally:
        object.__setattr__(spec, "kernel", kernel)
    return seen


def best(fn, reps: int, clock) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = clock()
        fn()
        out.append(clock() - t)
    return min(out) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/bench.yaml")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--reps", type=int, default=5, help="timed calls per variant and round (best kept)")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds of all variants")
    p.add_argument("--torch", action="store_true", help="also torch.matmul in the same process")
    p.add_argument("--threads", type=int, default=2, help="torch's threads")
    p.add_argument("--cpu-time", action="store_true", help="time the one-thread variants by CPU time")
    a = p.parse_args()
    cfg = load_config(a.config, a.set)
    emit("gemm_table", "load_average_1min", load_average(), "", **machine())
    table = trace_step(cfg)
    sgemm = cblas_sgemm()
    matmul = opspec.get("matmul")
    if a.torch:
        import torch

        torch.set_num_threads(a.threads)
    one = time.thread_time if a.cpu_time else time.perf_counter
    totals: dict[str, float] = {}
    rng = np.random.default_rng(0)
    for (xs, ys, tx, ty), rec in table.items():
        x, y = rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ys, dtype=np.float32)
        x2 = x.reshape(-1, xs[-1]) if not tx else x
        m, k = (x2.shape[1], x2.shape[0]) if tx else x2.shape
        n = ys[0] if ty else ys[1]
        out = np.empty((m, n), np.float32)
        variants = {"ours": lambda: matmul.kernel(np, x, y, transpose_x=tx, transpose_y=ty)}
        if sgemm is not None and x.dtype == np.float32:
            variants["sgemm"] = lambda: sgemm(x2, y, out, tx, ty)
        rows = products.RowProducts(matmul, tx, ty)
        if a.torch:
            tx_, ty_ = torch.from_numpy(x2), torch.from_numpy(y)
            tx_, ty_, tout = tx_.t() if tx else tx_, ty_.t() if ty else ty_, torch.empty(m, n)
        times: dict[str, list[float]] = {}
        for _ in range(a.rounds):
            for threads in (1, 2):
                blas.set_blas_threads(threads)
                for name, fn in variants.items():
                    times.setdefault(f"{name}_t{threads}", []).append(
                        best(fn, a.reps, one if threads == 1 else time.perf_counter)
                    )
            blas.set_blas_threads(2)
            times.setdefault("rows", []).append(best(lambda: rows(np, x, y), a.reps, time.perf_counter))
            if a.torch:
                times.setdefault("torch", []).append(
                    best(lambda: torch.matmul(tx_, ty_, out=tout), a.reps, time.perf_counter)
                )
        us = {v: round(min(t), 1) for v, t in times.items()}
        for v, t in us.items():
            totals[v] = totals.get(v, 0.0) + t * rec["calls"]
        flop = 2.0 * m * n * k
        label = f"{'T' if tx else ''}{list(xs)} @ {'T' if ty else ''}{list(ys)} -> [{m}, {n}]"
        emit("gemm_table", label, flop / 1e9, "GFLOP", calls=rec["calls"], contiguous=rec["contiguous"],
             us=us, best_gflops=round(flop / min(us.values()) / 1e3, 1))  # fmt: skip
    for v, t in totals.items():  # each variant over the whole step: every product times its calls
        emit("gemm_table", f"step_{v}_us", t, "us", over_sgemm_t2=round(t / totals.get("sgemm_t2", t), 3))
    emit("gemm_table", "load_average_1min_after", load_average(), "", cpu_time=a.cpu_time)


if __name__ == "__main__":
    main()
