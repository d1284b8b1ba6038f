"""Contractions: matmul (and linear = matmul + bias), which stay with BLAS / cuBLAS.

Each is declared by its einsum string (``spmd.Einsum``), from which its shape rule and its SPMD rule
follow; the transpose flags swap an operand's letters. Their VJPs are written out: the weight's
gradient is one GEMM over the flattened batch, which the generic einsum transpose would not give.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend as B
from ..dispatch import O
from ..opspec import A, Kind, OpError, attr, defop
from . import spmd as P

MATMUL = P.Einsum("...mk,...kn->...mn")
LINEAR = P.Einsum("...k,nk->...n")  # weight [out_features, in_features]


def matmul_einsum(transpose_x: bool = False, transpose_y: bool = False, **_) -> P.Einsum:
    e = MATMUL.swapped(0) if transpose_x else MATMUL
    return e.swapped(1) if transpose_y else e


def _mm_check(name, x, y):
    if x.ndim < 2 or y.ndim < 2:
        raise OpError(f"{name}: both inputs need at least 2 dims (use reshape/unsqueeze)", x, y)
    if x.dtype == B.DTYPES["bool"]:
        raise OpError(f"{name}: expects numeric tensors", x, y)


def _matmul_meta(x, y, transpose_x=False, transpose_y=False):
    _mm_check("matmul", x, y)
    flags = f"{', transpose_x' if transpose_x else ''}{', transpose_y' if transpose_y else ''}"
    return matmul_einsum(transpose_x, transpose_y).meta("matmul", x, y, flags=flags)


_GEMM = (B.DTYPES["float32"], B.DTYPES["float64"])


def mm(xp, x, y):
    """``xp.matmul`` in the dtype of ``x``: numpy multiplies bfloat16 (ml_dtypes) into float32.
    Two C-contiguous float matrices of one dtype, no dim below 2, go through ``ndarray.dot``: the
    same BLAS gemm call as ``matmul`` (so the same bits), without the ufunc's setup (~0.7 µs)."""
    if x.ndim == 2 == y.ndim and x.dtype in _GEMM and y.dtype == x.dtype and xp is np:
        (m, k), n = x.shape, y.shape[1]
        if m > 1 and k > 1 and n > 1 and x.flags.c_contiguous and y.flags.c_contiguous:
            return x.dot(y)
    out = xp.matmul(x, y)
    return out if out.dtype == x.dtype else out.astype(x.dtype)


def _matmul_kernel(xp, x, y, transpose_x=False, transpose_y=False):
    if transpose_y:
        y = xp.swapaxes(y, -1, -2)
    if y.ndim == 2 and x.ndim > 2 and not transpose_x:
        # [..., K] @ [K, N] as one GEMM: numpy would otherwise loop over the batch in small GEMMs.
        # (rows spelled out: reshape(-1, 0) is ambiguous for an empty K, as a shard can be)
        out = mm(xp, x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), y)
        return out.reshape(x.shape[:-1] + (y.shape[-1],))
    if transpose_x:
        x = xp.swapaxes(x, -1, -2)
    return mm(xp, x, y)


def _flat(t):
    """[..., d] -> [N, d], so a weight's gradient is one GEMM instead of a batch then a sum."""
    return O.reshape(t, [-1, t.shape[-1]])


def _matmul_vjp(g, out, x, y, transpose_x=False, transpose_y=False):
    tx, ty = transpose_x, transpose_y

    def dx():
        return O.matmul(y, g, transpose_x=ty, transpose_y=True) if tx else O.matmul(g, y, transpose_y=not ty)

    def dy():
        if y.ndim == 2 and x.ndim > 2 and not tx:
            x2, g2 = _flat(x), _flat(g)
            return O.matmul(g2, x2, transpose_x=True) if ty else O.matmul(x2, g2, transpose_x=True)
        return O.matmul(g, x, transpose_x=True, transpose_y=tx) if ty else O.matmul(x, g, transpose_x=not tx)

    return dx, dy


defop(
    "matmul",
    Kind.CONTRACTION,
    inputs=("x", "y"),
    attrs=[attr("transpose_x", A.BOOL, False), attr("transpose_y", A.BOOL, False)],
    infer_meta=_matmul_meta,
    kernel=_matmul_kernel,
    vjp=_matmul_vjp,
    spmd=P.contraction(lambda attrs: matmul_einsum(**attrs)),
    doc="Batched matrix product with numpy broadcasting of the leading dims; "
    "transpose_x/transpose_y swap the last two dims of an input first.",
)


def _linear_meta(x, weight, bias=None):
    _mm_check("linear", x, weight)
    if weight.ndim != 2:
        raise OpError("linear: weight must be [out_features, in_features]", x, weight)
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype):
        raise OpError(f"linear: bias must be [{weight.shape[0]}] {B.dtype_name(x.dtype)}", x, weight, bias)
    return LINEAR.meta("linear", x, weight)


def _linear_kernel(xp, x, weight, bias=None):
    out = _matmul_kernel(xp, x, weight, transpose_y=True)
    if bias is not None:
        out += bias
    return out


def _linear_vjp(g, out, x, weight, bias=None):
    return (
        lambda: O.matmul(g, weight),
        lambda: O.matmul(_flat(g), _flat(x), transpose_x=True),
        None if bias is None else g,
    )


def _linear_decompose(x, weight, bias=None):
    y = O.matmul(x, weight, transpose_y=True)
    return y if bias is None else y + bias


defop(
    "linear",
    Kind.CONTRACTION,
    inputs=("x", "weight", "bias?"),
    infer_meta=_linear_meta,
    kernel=_linear_kernel,
    vjp=_linear_vjp,
    decompose=_linear_decompose,
    spmd=P.contraction(lambda attrs: LINEAR, bias=2),
    doc="x @ weight.T + bias with weight [out_features, in_features] (the Hugging Face layout).",
)
