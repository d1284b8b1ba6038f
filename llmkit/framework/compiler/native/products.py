"""Compiled programs' products on the kernels' threads: ``matmul`` as blocks of rows (``blas.matmul_rows``).

OpenBLAS's own threads split a product into pieces that meet at every block of the reduction; on
this project's shared 2-core machines a thread set aside there holds up the other many times per
product: a training step's weight gradients (``[256, 2048] @ [2048, 256]``) ran at 5-10 GFLOP/s on two
threads against 30-70 on one. Here each block of output rows is one single-threaded BLAS call, the
blocks claimed by whichever thread is free. A block's values depend only on the shapes (the block
size follows from them), never on the thread that computes it, so a program's results do not
depend on the machine's load; they differ from OpenBLAS's whole-product call by float32 rounding
(another split of the same sums).

Only a product of two matrices (a batch of rows times a matrix: the linears and their gradients)
large enough to pay for the hand-off takes this path; the others keep the reference kernel.
Off by default (``LLMKIT_SPLIT_GEMMS=1`` turns it on): on a quiet 2-core host OpenBLAS's own two
threads are as fast or faster (0.94-0.98x with row products); under load they win 1.8x.
``LLMKIT_SPLIT_GEMMS=long`` takes this path only for products with a long reduction (``LONG_K``: a
weight gradient sums over every token of the batch; so do the LM head's): OpenBLAS's two threads
meet once per block of the reduction, so these are the products they stall on most (at load 15,
``benchmarks/gemm_table.py``: ``[2048, 256].T @ [2048, 256]`` 50x its one-thread CPU time). Which
thread computes a block, and when, never changes its bits (``tests/framework/test_blas.py`` forces
other schedules); OpenBLAS is held on one thread while any row product runs, counted across Python
threads, so overlapping callers (simulated ranks) never leave the process on one thread.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ...blas import matmul_rows
from ...ir import Operation
from ..build import CPUS

mode = os.environ.get("LLMKIT_SPLIT_GEMMS", "0")  # "0": off, "1": every product, "long": long reductions
enabled = mode in ("1", "long")
LONG_K = 1024  # "long": a shorter reduction keeps OpenBLAS's own threads
MIN_FLOPS = 1 << 24  # below: one BLAS call as it is (the hand-off costs tens of microseconds)
ROWS = 64  # a block's rows at the least (a multiple of the BLAS kernels' row tiles)
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class RowProducts:
    """``matmul(x, y, transpose_x, transpose_y)`` called like its reference kernel, with ``x`` a
    matrix or a batch of rows ([..., K]) and ``y`` a matrix."""

    profile_name = "llm.matmul[rows]"

    def __init__(self, spec: Any, tx: bool, ty: bool) -> None:
        self.spec, self.tx, self.ty = spec, tx, ty
        self.min_k = LONG_K if mode == "long" else 0  # the mode when the program was compiled

    def __call__(self, xp: Any, x: Any, y: Any, **attrs: Any) -> Any:
        if xp is not np or x.dtype != y.dtype or x.dtype not in _DTYPES or y.ndim != 2:
            return self.spec.kernel(xp, x, y, **attrs)
        a = x.T if self.tx else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        b = y.T if self.ty else y
        m, k = a.shape
        n = b.shape[1]
        if 2 * m * k * n < MIN_FLOPS or m < 2 * ROWS or k < self.min_k:
            return self.spec.kernel(xp, x, y, **attrs)
        out = np.empty((m, n), x.dtype)
        blocks = max(2 * CPUS, m // 1024)  # a few per thread, so a late one leaves nothing undone
        rows = -(-max(ROWS, -(-m // blocks)) // 16) * 16
        matmul_rows(a, b, out, CPUS, rows)
        return out if self.tx else out.reshape((*x.shape[:-1], n))


def kernel_of(op: Operation) -> RowProducts | None:
    """The row-block kernel of a ``matmul`` op of a compiled program, or None (the op keeps its own)."""
    if not enabled or CPUS < 2 or op.name != "llm.matmul" or len(op.operands) != 2:
        return None
    x, y = op.operands
    tx, ty = bool(op.plain_attrs.get("transpose_x")), bool(op.plain_attrs.get("transpose_y"))
    if y.ndim != 2 or (tx and x.ndim != 2) or x.ndim < 2:
        return None
    return RowProducts(op.opdef.spec, tx, ty)
