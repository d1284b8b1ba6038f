"""The registry walk: every op in the table is checked here, or the suite fails.

For each op and each sample: (a) a central finite-difference gradient check in float64 for every
differentiable input, (b) ``infer_meta`` equals the kernel's real output shape and dtype (also with
the input dims made symbolic), (c) ``decompose`` computes the kernel's values, and (d) forward
values equal an independent numpy float64 formula written below (and float32 runs stay close).
Collectives run on one thread per rank of the ``sim`` backend (``Case.ranks``): a sample holds every
rank's inputs stacked on a leading axis and its attributes as a function of the rank.
The forward and gradient checks take the ``device`` fixture: their GPU twins run every kernel
with cupy (``pytest -m gpu``), each result required to stay on the GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework import symbolic as sym
from llmkit.framework.opspec import Meta, table

O = lf.ops
END = 2**63 - 1


@dataclass
class S:
    """One sample: inputs (numpy arrays, None for omitted optional inputs) and attributes."""

    inputs: list
    attrs: dict | Callable = field(default_factory=dict)  # collectives: rank -> attributes
    fd: bool = True  # run the finite-difference check
    sym: bool = True  # also check infer_meta with symbolic input dims
    keep: tuple = ()  # (input, axis) pairs that stay static in the symbolic check (head dims...)


@dataclass
class Case:
    samples: Callable[[np.random.Generator], list[S]]
    ref: Callable[..., Any]  # collectives: ref(rank, *stacked inputs, **attrs) -> that rank's output
    rtol: float = 1e-10
    atol: float = 1e-12
    ranks: int = 1  # a collective: run on this many ranks (one thread each)
    before: Callable[..., Any] | None = None  # collectives: before(rank, attrs) runs on each rank first
    after: Callable[..., Any] | None = None  # and after(rank, attrs) last


CASES: dict[str, Case] = {}


def case(name, samples, ref, **kw):
    CASES[name] = Case(samples, ref, **kw)


def r(rng, *shape):
    return np.asarray(rng.standard_normal(shape))


def pos(rng, *shape):
    return np.asarray(rng.uniform(0.5, 2.0, shape))


def away(rng, *shape):  # magnitudes in [0.2, 1], random signs: no kinks near 0 for FD
    return np.asarray(rng.uniform(0.2, 1.0, shape) * rng.choice([-1.0, 1.0], shape))


def ints(rng, high, *shape):
    return rng.integers(0, high, shape).astype(np.int64)


def bshapes(rng, gen=r):
    return [
        S([gen(rng, 3, 4), gen(rng, 3, 4)]),
        S([gen(rng, 2, 3, 4), gen(rng, 4)]),
        S([gen(rng, 3, 1), gen(rng, 1, 4)]),
    ]


def ushapes(rng, gen=r):
    return [S([gen(rng, 3, 4)]), S([gen(rng, 2, 1, 5)]), S([gen(rng)])]


# ---- elementwise --------------------------------------------------------------------------------

case("add", bshapes, lambda a, b: a + b)
case("sub", bshapes, lambda a, b: a - b)
case("mul", bshapes, lambda a, b: a * b)
case(
    "div", lambda rng: [S([r(rng, 3, 4), pos(rng, 3, 4)]), S([r(rng, 2, 3), pos(rng, 3)])], lambda a, b: a / b
)
case(
    "pow",
    lambda rng: [S([pos(rng, 3, 4), r(rng, 3, 4)]), S([pos(rng, 2, 3), r(rng, 1, 3)])],
    lambda a, b: np.exp(b * np.log(a)),
)
case("maximum", bshapes, lambda a, b: np.where(a > b, a, b))
case("minimum", bshapes, lambda a, b: np.where(a < b, a, b))
case("swiglu", bshapes, lambda a, b: a / (1 + np.exp(-a)) * b)
case("neg", ushapes, lambda x: 0.0 - x)
case("abs", lambda rng: ushapes(rng, away), lambda x: np.sqrt(x * x))
case("sign", lambda rng: ushapes(rng, away), lambda x: np.where(x > 0, 1.0, np.where(x < 0, -1.0, 0.0)))
case("exp", ushapes, lambda x: np.e**x)
case("log", lambda rng: ushapes(rng, pos), lambda x: np.log2(x) * np.log(2.0))
case("sqrt", lambda rng: ushapes(rng, pos), lambda x: x**0.5)
case("rsqrt", lambda rng: ushapes(rng, pos), lambda x: x**-0.5)
case("sin", ushapes, np.sin)
case("cos", ushapes, np.cos)
case("tanh", ushapes, lambda x: (np.exp(2 * x) - 1) / (np.exp(2 * x) + 1))
case("sigmoid", ushapes, lambda x: 1 / (1 + np.exp(-x)))
case("relu", lambda rng: ushapes(rng, away), lambda x: x * (x > 0))
case("silu", ushapes, lambda x: x / (1 + np.exp(-x)))


def _erf_ref(x):
    # Independent of math.erf: Simpson's rule on 2/sqrt(pi) * exp(-t^2) over [0, x].
    t = np.linspace(0.0, 1.0, 2001)
    w = np.ones_like(t)
    w[1:-1:2], w[2:-1:2] = 4, 2
    flat = np.asarray(x, np.float64).reshape(-1)
    vals = [(xi / 6000.0) * np.sum(w * np.exp(-((t * xi) ** 2))) * 2 / np.sqrt(np.pi) for xi in flat]
    return np.array(vals).reshape(np.shape(x))


case("erf", ushapes, _erf_ref, rtol=1e-9, atol=1e-12)


def _gelu_ref(x, approximate="none"):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + _erf_ref(x / np.sqrt(2)))


case(
    "gelu", lambda rng: [S([r(rng, 3, 4)]), S([r(rng, 2, 5)], {"approximate": "tanh"})], _gelu_ref, rtol=1e-9
)


def compares(rng):
    a = ints(rng, 4, 3, 4).astype(np.float64)
    return [
        S([a, ints(rng, 4, 3, 4).astype(np.float64)]),
        S([a, ints(rng, 4, 4).astype(np.float64)]),
        S([ints(rng, 5, 2, 3), ints(rng, 5, 3)]),
    ]


case(
    "equal",
    compares,
    lambda a, b: np.asarray([x == y for x, y in np.broadcast(a, b)]).reshape(np.broadcast(a, b).shape),
)
case("not_equal", compares, lambda a, b: ~(np.broadcast_to(a, np.broadcast(a, b).shape) == b))
case("less", compares, lambda a, b: (b - a) > 0)
case("less_equal", compares, lambda a, b: (b - a) >= 0)
case("greater", compares, lambda a, b: (a - b) > 0)
case("greater_equal", compares, lambda a, b: (a - b) >= 0)


def bools(rng):
    return [
        S([rng.random((3, 4)) > 0.5, rng.random((3, 4)) > 0.5]),
        S([rng.random((2, 4)) > 0.5, rng.random(4) > 0.5]),
    ]


case("logical_and", bools, lambda a, b: (a.astype(int) + b.astype(int)) == 2)
case("logical_or", bools, lambda a, b: (a.astype(int) + b.astype(int)) >= 1)
case("logical_not", lambda rng: [S([rng.random((3, 4)) > 0.5])], lambda a: a == 0)
case(
    "where",
    lambda rng: [
        S([rng.random((3, 4)) > 0.5, r(rng, 3, 4), r(rng, 3, 4)]),
        S([rng.random((3, 1)) > 0.5, r(rng, 4), r(rng, 3, 4)]),
    ],
    lambda c, a, b: c * a + (1 - c) * b,
)
case(
    "cast",
    lambda rng: [
        S([r(rng, 3, 4)], {"dtype": "float64"}),
        S([r(rng, 3, 4)], {"dtype": "float32"}, fd=False),
        S([r(rng, 3, 4) * 5], {"dtype": "int32"}, fd=False),
    ],
    lambda x, dtype: np.trunc(x) if dtype == "int32" else x,
    rtol=1e-6,
    atol=1e-7,
)
case(
    "zeros_like",
    lambda rng: [S([r(rng, 3, 4)]), S([ints(rng, 3, 2, 2)], {"dtype": "float32"})],
    lambda x, dtype=None: x * 0,
)
case(
    "ones_like",
    lambda rng: [S([r(rng, 3, 4)]), S([ints(rng, 3, 2, 2)], {"dtype": "float32"})],
    lambda x, dtype=None: x * 0 + 1,
)
case(
    "full",
    lambda rng: [
        S([], {"shape": [2, 3], "value": 1.5, "dtype": "float64"}),
        S([], {"shape": [], "value": -2.0, "dtype": "float32"}),
    ],
    lambda shape, value, dtype: np.ones(shape) * value,
)

# ---- reductions ---------------------------------------------------------------------------------


def red(rng, gen=r):
    return [
        S([gen(rng, 3, 4)]),
        S([gen(rng, 2, 3, 4)], {"axis": 1}),
        S([gen(rng, 2, 3, 4)], {"axis": [0, 2], "keepdim": True}),
        S([gen(rng, 3, 4)], {"axis": -1, "keepdim": True}),
    ]


def _np_reduce(f):
    def ref(x, axis=None, keepdim=False):
        ax = None if axis is None else tuple(a % x.ndim for a in np.atleast_1d(axis))
        return f(x, axis=ax, keepdims=keepdim)

    return ref


case("sum", red, _np_reduce(lambda x, axis, keepdims: np.add.reduce(x, axis=axis, keepdims=keepdims)))
case(
    "mean",
    red,
    _np_reduce(
        lambda x, axis, keepdims: (
            np.add.reduce(x, axis=axis, keepdims=keepdims)
            * np.add.reduce(x, axis=axis, keepdims=keepdims).size
            / x.size
        )
    ),
)
case("max", red, _np_reduce(lambda x, axis, keepdims: np.maximum.reduce(x, axis=axis, keepdims=keepdims)))
case("min", red, _np_reduce(lambda x, axis, keepdims: np.minimum.reduce(x, axis=axis, keepdims=keepdims)))
case(
    "logsumexp",
    red,
    _np_reduce(lambda x, axis, keepdims: np.log(np.add.reduce(np.exp(x), axis=axis, keepdims=keepdims))),
)
case(
    "argmax",
    lambda rng: [
        S([r(rng, 3, 4)]),
        S([r(rng, 2, 3, 4)], {"axis": 1}),
        S([r(rng, 3, 4)], {"axis": -1, "keepdim": True}),
    ],
    lambda x, axis=None, keepdim=False: (
        np.array([int(np.flatnonzero(x.ravel() == x.max())[0])]).reshape(())
        if axis is None
        else np.apply_along_axis(lambda v: np.flatnonzero(v == v.max())[0], axis, x).reshape(
            [1 if i == axis % x.ndim else d for i, d in enumerate(x.shape)]
            if keepdim
            else [d for i, d in enumerate(x.shape) if i != axis % x.ndim]
        )
    ),
)
case(
    "numel",
    lambda rng: [S([r(rng, 3, 4)]), S([r(rng, 2, 3, 4)], {"axis": [0, 2]})],
    lambda x, axis=None: np.asarray(float(np.prod([x.shape[a] for a in (axis or range(x.ndim))]))),
)
case(
    "cumsum",
    lambda rng: [S([r(rng, 3, 4)], {"axis": 1}), S([r(rng, 3, 4)], {"axis": 0, "reverse": True})],
    lambda x, axis, reverse=False: np.stack(
        [
            np.add.reduce(
                np.take(x, range(i, x.shape[axis]) if reverse else range(i + 1), axis=axis), axis=axis
            )
            for i in range(x.shape[axis])
        ],
        axis=axis,
    ),
)

# ---- movement -----------------------------------------------------------------------------------

case(
    "reshape",
    lambda rng: [
        S([r(rng, 3, 4)], {"shape": [2, 6]}, sym=False),
        S([r(rng, 2, 3, 4)], {"shape": [-1, 4]}, keep=((0, 2),)),
    ],
    lambda x, shape: np.array(x.ravel().tolist()).reshape(shape),
)
case(
    "transpose",
    lambda rng: [S([r(rng, 3, 4)], {"perm": [1, 0]}), S([r(rng, 2, 3, 4)], {"perm": [2, 0, 1]})],
    lambda x, perm: np.einsum(x, list(range(x.ndim)), list(perm)),
)
case(
    "expand",
    lambda rng: [
        S([r(rng, 3, 1)], {"shape": [3, 4]}, sym=False),
        S([r(rng, 4)], {"shape": [2, 3, 4]}, sym=False),
        S([r(rng, 1, 4)], {"shape": [5, -1]}, sym=False),
    ],
    lambda x, shape: (
        x + np.zeros([d if d != -1 else x.shape[i - len(shape) + x.ndim] for i, d in enumerate(shape)])
    ),
)
case(
    "squeeze",
    lambda rng: [S([r(rng, 3, 1, 4)], {"axis": [1]}), S([r(rng, 1, 3, 1)])],
    lambda x, axis=None: x.reshape([d for d in x.shape if d != 1]),
)
case(
    "unsqueeze",
    lambda rng: [S([r(rng, 3, 4)], {"axis": [0]}), S([r(rng, 3, 4)], {"axis": [1, -1]})],
    lambda x, axis: x.reshape({(0,): (1, 3, 4), (1, -1): (3, 1, 4, 1)}[tuple(axis)]),
)


def _slice_ref(x, axes, starts, ends, steps=None):
    idx = [slice(None)] * x.ndim
    for a, s, e, st in zip(axes, starts, ends, steps or [1] * len(axes)):
        idx[a] = slice(s, None if e == END else e, st)
    return np.array(x[tuple(idx)])


case(
    "slice",
    lambda rng: [
        S([r(rng, 5, 6)], {"axes": [0, 1], "starts": [1, 0], "ends": [4, END], "steps": [1, 2]}, sym=False),
        S([r(rng, 4, 6)], {"axes": [1], "starts": [-3], "ends": [END]}),
        S([r(rng, 4, 6)], {"axes": [0], "starts": [1], "ends": [3]}),
    ],
    _slice_ref,
)


def _slice_scatter_ref(x, src, axes, starts, ends, steps=None):
    out = x.copy()
    idx = [slice(None)] * x.ndim
    for a, s, e, st in zip(axes, starts, ends, steps or [1] * len(axes)):
        idx[a] = slice(s, None if e == END else e, st)
    out[tuple(idx)] = src
    return out


case(
    "slice_scatter",
    lambda rng: [
        S(
            [r(rng, 5, 6), r(rng, 3, 3)],
            {"axes": [0, 1], "starts": [1, 0], "ends": [4, END], "steps": [1, 2]},
            sym=False,
        ),
        S([r(rng, 4, 6), r(rng, 4, 2)], {"axes": [1], "starts": [2], "ends": [4]}, sym=False),
    ],
    _slice_scatter_ref,
)
case(
    "concat",
    lambda rng: [
        S([r(rng, 2, 3), r(rng, 4, 3)], {"axis": 0}),
        S([r(rng, 2, 3), r(rng, 2, 1), r(rng, 2, 2)], {"axis": -1}),
        S([r(rng, 3)]),
    ],
    lambda *xs, axis=0: np.concatenate(xs, axis=axis),
)
case(
    "stack",
    lambda rng: [
        S([r(rng, 2, 3), r(rng, 2, 3)], {"axis": 0}),
        S([r(rng, 2, 3), r(rng, 2, 3), r(rng, 2, 3)], {"axis": -1}),
    ],
    lambda *xs, axis=0: np.moveaxis(np.array([x.tolist() for x in xs]), 0, axis),
)
case(
    "split",
    lambda rng: [
        S([r(rng, 6, 3)], {"sections": 3}, keep=((0, 0),)),
        S([r(rng, 2, 7)], {"sections": [2, 5], "axis": 1}, sym=False),
    ],
    lambda x, sections, axis=0: tuple(
        np.array_split(x, sections, axis)
        if isinstance(sections, int)
        else np.split(x, np.cumsum(sections)[:-1], axis)
    ),
)
case(
    "index_select",
    lambda rng: [S([r(rng, 5, 3), np.array([4, 0, 4, 2])]), S([r(rng, 2, 5), np.array([1, 3])], {"axis": 1})],
    lambda x, i, axis=0: np.moveaxis(np.array([np.moveaxis(x, axis, 0)[k] for k in i]), 0, axis),
)


def _index_add_ref(x, i, src, axis=0):
    out = np.moveaxis(x.copy(), axis, 0)
    s = np.moveaxis(src, axis, 0)
    for n, k in enumerate(i):
        out[k] += s[n]
    return np.moveaxis(out, 0, axis)


case(
    "index_add",
    lambda rng: [
        S([r(rng, 5, 3), np.array([4, 0, 4]), r(rng, 3, 3)]),
        S([r(rng, 2, 5), np.array([1, 1]), r(rng, 2, 2)], {"axis": 1}),
    ],
    _index_add_ref,
)


def _gather_ref(x, i, axis=0):
    out = np.empty(i.shape)
    for idx in np.ndindex(*i.shape):
        src = list(idx)
        src[axis] = i[idx]
        out[idx] = x[tuple(src)]
    return out


def _scatter_add_ref(x, i, src, axis=0):
    out = x.copy()
    for idx in np.ndindex(*i.shape):
        dst = list(idx)
        dst[axis] = i[idx]
        out[tuple(dst)] += src[idx]
    return out


case(
    "gather",
    lambda rng: [S([r(rng, 4, 3), ints(rng, 4, 2, 3)]), S([r(rng, 3, 5), ints(rng, 5, 3, 2)], {"axis": 1})],
    _gather_ref,
)
case(
    "scatter_add",
    lambda rng: [
        S([r(rng, 4, 3), ints(rng, 4, 2, 3), r(rng, 2, 3)]),
        S([r(rng, 3, 5), ints(rng, 5, 3, 2), r(rng, 3, 2)], {"axis": 1}),
    ],
    _scatter_add_ref,
)
case(
    "embedding",
    lambda rng: [S([ints(rng, 5, 2, 3), r(rng, 5, 4)]), S([np.array([1, 1, 0]), r(rng, 3, 2)])],
    lambda ids, w: np.array([[w[k] for k in row] for row in ids.reshape(-1, ids.shape[-1])]).reshape(
        ids.shape + (w.shape[1],)
    ),
)
case(
    "tril",
    lambda rng: [S([r(rng, 4, 4)]), S([r(rng, 2, 3, 5)], {"diagonal": 1})],
    lambda x, diagonal=0: x * (np.arange(x.shape[-1])[None, :] <= np.arange(x.shape[-2])[:, None] + diagonal),
)
case(
    "triu",
    lambda rng: [S([r(rng, 4, 4)]), S([r(rng, 2, 3, 5)], {"diagonal": -1})],
    lambda x, diagonal=0: x * (np.arange(x.shape[-1])[None, :] >= np.arange(x.shape[-2])[:, None] + diagonal),
)
case(
    "one_hot",
    lambda rng: [
        S([ints(rng, 4, 3)], {"num_classes": 4}),
        S([ints(rng, 3, 2, 2)], {"num_classes": 5, "dtype": "float64"}),
    ],
    lambda x, num_classes, dtype="float32": np.eye(num_classes)[x],
)


def _topk_ref(x, k, axis=-1, largest=True):
    xs = np.moveaxis(x, axis, -1)
    idx = np.array(
        [
            sorted(range(v.shape[0]), key=lambda j: -v[j] if largest else v[j])[:k]
            for v in xs.reshape(-1, xs.shape[-1])
        ]
    )
    idx = idx.reshape(xs.shape[:-1] + (k,))
    vals = np.take_along_axis(xs, idx, -1)
    return np.moveaxis(vals, -1, axis), np.moveaxis(idx, -1, axis)


case(
    "topk",
    lambda rng: [
        S([r(rng, 3, 6)], {"k": 2}),
        S([r(rng, 5, 3)], {"k": 3, "axis": 0, "largest": False}, sym=False),
    ],
    _topk_ref,
)
case(
    "arange",
    lambda rng: [S([], {"end": 5}), S([], {"start": 2, "end": 11, "step": 3, "dtype": "float64"})],
    lambda start=0, end=None, step=1, dtype="int64": np.array(list(range(start, end, step))),
)

# ---- contraction --------------------------------------------------------------------------------


def _mm_ref(x, y, transpose_x=False, transpose_y=False):
    if transpose_x:
        x = np.swapaxes(x, -1, -2)
    if transpose_y:
        y = np.swapaxes(y, -1, -2)
    return np.einsum("...ik,...kj->...ij", x, y)


case(
    "matmul",
    lambda rng: [
        S([r(rng, 3, 4), r(rng, 4, 2)]),
        S([r(rng, 2, 3, 4), r(rng, 4, 5)]),
        S([r(rng, 2, 4, 3), r(rng, 1, 5, 4)], {"transpose_x": True, "transpose_y": True}),
    ],
    _mm_ref,
)
case(
    "linear",
    lambda rng: [
        S([r(rng, 2, 3, 4), r(rng, 5, 4), r(rng, 5)], keep=((1, 0), (2, 0))),
        S([r(rng, 3, 4), r(rng, 2, 4)]),
    ],
    lambda x, w, b=None: np.einsum("...i,oi->...o", x, w) + (0 if b is None else b),
)

# ---- composite neural ops -----------------------------------------------------------------------


def _softmax_ref(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


case("softmax", lambda rng: [S([r(rng, 3, 5)]), S([r(rng, 2, 3, 4)], {"axis": 1})], _softmax_ref)
case(
    "log_softmax",
    lambda rng: [S([r(rng, 3, 5)]), S([r(rng, 2, 3, 4)], {"axis": 0})],
    lambda x, axis=-1: np.log(_softmax_ref(x, axis)),
    rtol=1e-9,
)
case(
    "rms_norm",
    lambda rng: [S([r(rng, 3, 6), r(rng, 6)]), S([r(rng, 2, 2, 4), r(rng, 4)], {"eps": 1e-3})],
    lambda x, w, eps=1e-6: x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w,
)


def _ce_ref(logits, labels, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    c = logits.shape[-1]
    flat, lab = logits.reshape(-1, c), labels.reshape(-1)
    losses = []
    for row, y in zip(flat, lab):
        if y == ignore_index:
            losses.append(0.0)
            continue
        logp = row - np.log(np.sum(np.exp(row)))
        q = np.full(c, label_smoothing / c)
        q[y] += 1 - label_smoothing
        losses.append(-np.sum(q * logp))
    losses = np.array(losses).reshape(labels.shape)
    n = np.sum(lab != ignore_index)
    return {"none": losses, "sum": losses.sum(), "mean": losses.sum() / n}[reduction]


case(
    "cross_entropy",
    lambda rng: [
        S([r(rng, 5, 4), np.array([0, 3, -100, 1, 3])]),
        S([r(rng, 2, 3, 4), ints(rng, 4, 2, 3)], {"label_smoothing": 0.1}),
        S([r(rng, 4, 3), np.array([2, -1, 0, -1])], {"ignore_index": -1, "reduction": "sum"}),
        S([r(rng, 4, 3), np.array([2, 1, 0, 1])], {"reduction": "none"}),
    ],
    _ce_ref,
)


def _token_logprobs_ref(logits, tokens, temperature=1.0):
    out = np.zeros(tokens.shape)
    for idx in np.ndindex(*tokens.shape):
        z = [x / temperature for x in logits[idx]]
        out[idx] = z[tokens[idx]] - math.log(sum(math.exp(x) for x in z))
    return out


case(
    "token_logprobs",
    lambda rng: [
        S([r(rng, 5, 7), ints(rng, 7, 5)]),
        S([3 * r(rng, 2, 3, 4), ints(rng, 4, 2, 3)], {"temperature": 0.6}),
    ],
    _token_logprobs_ref,
)


def _rope_tables(rng, positions, d):
    ang = np.arange(positions)[:, None] * rng.uniform(0.1, 1.0, d // 2)[None, :]
    ang = np.concatenate([ang, ang], -1)
    return np.cos(ang), np.sin(ang)


def _rope_samples(rng):
    c, s = _rope_tables(rng, 7, 4)
    d = ((0, 3), (1, 1), (2, 1))  # the head dim is static
    return [
        S([r(rng, 2, 3, 5, 4), c[:5], s[:5]], keep=d),
        S([r(rng, 2, 3, 4, 4), c, s, np.array([[0, 1, 2, 3], [3, 4, 5, 6]])], keep=d),
    ]


def _rope_ref(x, cos, sin, pos=None):
    h = x.shape[-1] // 2
    out = np.empty_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        p = idx[-1] if pos is None else pos[idx[0], idx[-1]]
        v = x[idx]
        rot = np.concatenate([-v[h:], v[:h]])
        out[idx] = v * cos[p] + rot * sin[p]
    return out


case("rotary_embedding", _rope_samples, _rope_ref)


def _sdpa_samples(rng):
    mask = np.where(rng.random((1, 1, 3, 5)) > 0.3, 0.0, -1e9)
    mask[..., 0] = 0.0
    heads = ((0, 1), (1, 1), (2, 1), (0, 3), (1, 3), (2, 3))  # head counts and head dims are static
    return [
        S([r(rng, 2, 4, 3, 2), r(rng, 2, 2, 3, 2), r(rng, 2, 2, 3, 3)], {"is_causal": True}, keep=heads),
        S([r(rng, 1, 2, 3, 2), r(rng, 1, 2, 5, 2), r(rng, 1, 2, 5, 2), mask], {"scale": 0.7}, keep=heads),
        S([r(rng, 1, 2, 2, 2), r(rng, 1, 1, 4, 2), r(rng, 1, 1, 4, 2)], {"is_causal": True}, keep=heads),
    ]


def _sdpa_ref(q, k, v, mask=None, is_causal=False, scale=None):
    b, hq, s, d = q.shape
    hk, t = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, hq, s, v.shape[-1]))
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hk)
            for i in range(s):
                sc = np.array([q[bi, h, i] @ k[bi, kh, j] * scale for j in range(t)])
                if mask is not None:
                    sc = sc + np.broadcast_to(mask, (b, hq, s, t))[bi, h, i]
                if is_causal:
                    sc = np.where(np.arange(t) <= i + t - s, sc, -np.inf)
                p = np.exp(sc - sc.max())
                out[bi, h, i] = (p / p.sum()) @ v[bi, kh]
    return out


case("scaled_dot_product_attention", _sdpa_samples, _sdpa_ref)


def _sdpa_grad_samples(rng):
    def sample(b, hq, hk, s, t, d, dv, *extra, **attrs):
        ins = [r(rng, b, hq, s, dv), r(rng, b, hq, s, dv), r(rng, b, hq, s, d), r(rng, b, hk, t, d)]
        heads = tuple((i, a) for i in range(5) for a in (1, 3))  # head counts and head dims are static
        return S([*ins, r(rng, b, hk, t, dv), *extra], attrs, keep=heads)

    mask = np.where(rng.random((1, 1, 3, 5)) > 0.3, 0.0, -1e9)
    mask[..., 0] = 0.0
    return [
        sample(2, 4, 2, 3, 3, 2, 3, is_causal=True),
        sample(1, 2, 2, 3, 5, 2, 2, mask, scale=0.7),
        sample(1, 2, 1, 2, 4, 2, 2, is_causal=True),  # a query block after 2 cached keys
    ]


def _sdpa_grad_ref(g, out, q, k, v, mask=None, is_causal=False, scale=None):
    b, hq, s, d = q.shape
    hk, t = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hk)
            sc = np.einsum("id,jd->ij", q[bi, h], k[bi, kh]) * scale
            if mask is not None:
                sc = sc + np.broadcast_to(mask, (b, hq, s, t))[bi, h]
            if is_causal:
                sc = np.where(np.arange(t)[None, :] <= np.arange(s)[:, None] + t - s, sc, -np.inf)
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            dp = np.einsum("ie,je->ij", g[bi, h], v[bi, kh])
            ds = p * (dp - np.einsum("ie,ie->i", g[bi, h], out[bi, h])[:, None])
            dq[bi, h] = ds @ k[bi, kh] * scale
            dk[bi, kh] += ds.T @ q[bi, h] * scale
            dv[bi, kh] += p.T @ g[bi, h]
    return dq, dk, dv


case("scaled_dot_product_attention_grad", _sdpa_grad_samples, _sdpa_grad_ref)


def _sdpa_lse_samples(rng):
    heads = ((0, 1), (1, 1), (2, 1), (0, 3), (1, 3), (2, 3))
    return [
        S([r(rng, 2, 4, 3, 2), r(rng, 2, 2, 3, 2), r(rng, 2, 2, 3, 3)], {"is_causal": True}, keep=heads),
        S([r(rng, 1, 2, 3, 2), r(rng, 1, 2, 5, 2), r(rng, 1, 2, 5, 2)], {"scale": 0.7}, keep=heads),
        S([r(rng, 1, 2, 2, 2), r(rng, 1, 1, 4, 2), r(rng, 1, 1, 4, 2)], {"is_causal": True}, keep=heads),
    ]


def _sdpa_lse_ref(q, k, v, is_causal=False, scale=None):
    b, hq, s, d = q.shape
    hk, t = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    lse = np.zeros((b, hq, s))
    for bi in range(b):
        for h in range(hq):
            for i in range(s):
                seen = t if not is_causal else i + t - s + 1
                sc = [q[bi, h, i] @ k[bi, h // (hq // hk), j] * scale for j in range(seen)]
                lse[bi, h, i] = math.log(sum(math.exp(x) for x in sc))
    return _sdpa_ref(q, k, v, None, is_causal, scale), lse


case("scaled_dot_product_attention_lse", _sdpa_lse_samples, _sdpa_lse_ref)


def _sdpa_lse_grad_samples(rng):
    def sample(b, hq, hk, s, t, d, dv, **attrs):
        q, k, v = r(rng, b, hq, s, d), r(rng, b, hk, t, d), r(rng, b, hk, t, dv)
        out, lse = _sdpa_lse_ref(q, k, v, **attrs)  # the forward's own: the kernel relies on them
        heads = tuple((i, a) for i in range(6) for a in (1, 3) if not (i == 2 and a == 3))
        return S([r(rng, b, hq, s, dv), out, lse, q, k, v], attrs, keep=heads)

    return [
        sample(2, 4, 2, 3, 3, 2, 3, is_causal=True),
        sample(1, 2, 2, 3, 5, 2, 2, scale=0.7),
        sample(1, 2, 1, 2, 4, 2, 2, is_causal=True),  # a query block after 2 cached keys
    ]


def _sdpa_lse_grad_ref(g, out, lse, q, k, v, is_causal=False, scale=None):
    return _sdpa_grad_ref(g, out, q, k, v, None, is_causal, scale)


case("scaled_dot_product_attention_lse_grad", _sdpa_lse_grad_samples, _sdpa_lse_grad_ref)


def test_attention_lse_grad_names_a_wrong_lse():
    rng = np.random.default_rng(0)
    q, k, v = (lf.tensor(r(rng, 1, 2, 3, 4).astype(np.float32)) for _ in range(3))
    out, lse = lf.ops.scaled_dot_product_attention_lse(q, k, v, is_causal=True)
    with pytest.raises(lf.OpError, match=r"_lse_grad: lse must be \[B, Hq, S\] in q's dtype"):
        lf.ops.scaled_dot_product_attention_lse_grad(out, out, out, q, k, v)  # lse given the output
    with pytest.raises(lf.OpError, match=r"_lse_grad: lse must be \[B, Hq, S\] in q's dtype"):
        lf.ops.scaled_dot_product_attention_lse_grad(out, out, lse.astype("float64"), q, k, v)


def _dropout_ref(x, step=None, p=0.5, seed=0):
    # Independent check: every output is either 0 or x / (1 - p); compared value-wise below.
    return None


case(
    "dropout",
    lambda rng: [
        S([r(rng, 4, 5)], {"p": 0.3, "seed": 7}),
        S([r(rng, 3)], {"p": 0.0, "seed": 1}),
        S([r(rng, 4, 5), np.array(3, np.int64)], {"p": 0.3, "seed": 7}),  # a static program's run_seed
    ],
    _dropout_ref,
)


# ---- inference ops (ops/paged.py) ---------------------------------------------------------------

case(
    "tiled_linear",
    lambda rng: [
        S([r(rng, 2, 3, 4), r(rng, 5, 4), r(rng, 5)], {"rows": 4}, keep=((1, 0), (2, 0))),
        S([r(rng, 3, 4), r(rng, 2, 4)], {"rows": 2}),
        S([r(rng, 5, 3), r(rng, 4, 3)], {"rows": 1}),
        S([r(rng, 1, 4), r(rng, 3, 4)]),
        S([r(rng, 2, 3, 4), r(rng, 4, 5), r(rng, 5)], {"rows": 2, "transposed": True}, keep=((1, 1), (2, 0))),
        # panels: out = 2 x 16 (static: the panel width, and the bias checked against 2 x 16)
        S(
            [r(rng, 3, 5), r(rng, 2, 5, 16), r(rng, 32)],
            {"rows": 2, "panel": 16},
            keep=((1, 0), (1, 2), (2, 0)),
        ),
        S([r(rng, 1, 2, 7), r(rng, 1, 7, 16)], {"rows": 1, "panel": 16}, keep=((1, 2),)),
    ],
    lambda x, w, b=None, rows=8, transposed=False, panel=0: (
        (
            np.einsum("...i,pic->...pc", x, w).reshape(x.shape[:-1] + (-1,))
            if panel
            else np.einsum("...i,io->...o" if transposed else "...i,oi->...o", x, w)
        )
        + (0 if b is None else b)
    ),
)


def _tls_ref(x, wg, wu, rows=8, transposed=False, panel=0):
    def lin(w):
        if panel:
            return np.einsum("...i,pic->...pc", x, w).reshape(x.shape[:-1] + (-1,))
        return np.einsum("...i,io->...o" if transposed else "...i,oi->...o", x, w)

    a, b = lin(wg), lin(wu)
    return a / (1 + np.exp(-a)) * b


case(
    "tiled_linear_swiglu",
    lambda rng: [
        S([r(rng, 2, 3, 4), r(rng, 5, 4), r(rng, 5, 4)], {"rows": 4}),
        S([r(rng, 3, 4), r(rng, 4, 6), r(rng, 4, 6)], {"rows": 1, "transposed": True}),
        S(
            [r(rng, 3, 5), r(rng, 2, 5, 16), r(rng, 2, 5, 16)],
            {"rows": 2, "panel": 16},
            keep=((1, 2), (2, 2)),
        ),
    ],
    _tls_ref,
)


def _tll_ref(x, w, targets, logit_rows, k=5, rows=8, transposed=False, panel=0):
    if panel:
        z = np.einsum("ni,pic->npc", x, w).reshape(len(x), -1)
    else:
        z = np.einsum("ni,io->no" if transposed else "ni,oi->no", x, w)
    z = z.astype(np.float64)
    lse = z.max(1, keepdims=True) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
    ids = np.array([sorted(range(z.shape[1]), key=lambda j: (-zr[j], j))[:k] for zr in z], np.int64)
    picked = z[np.arange(len(z)), targets] - lse[:, 0]
    return z[logit_rows], picked, np.take_along_axis(z, ids, 1) - lse, ids


case(
    "tiled_linear_logprobs",
    lambda rng: [
        S([r(rng, 4, 3), r(rng, 6, 3), ints(rng, 6, 4), np.array([3, 0])], {"k": 2}, fd=False),
        S(
            [r(rng, 3, 5), r(rng, 5, 7), ints(rng, 7, 3), np.array([1])],
            {"k": 3, "rows": 1, "transposed": True},
            fd=False,
        ),
        S(
            [r(rng, 5, 4), r(rng, 2, 4, 16), ints(rng, 32, 5), np.array([4, 4, 2])],
            {"k": 5, "rows": 2, "panel": 16},
            fd=False,
            keep=((1, 2),),
        ),
    ],
    _tll_ref,
)


def _slot_of(table, pos, block_size):
    return table[pos // block_size] * block_size + pos % block_size


def _paged_write_ref(pool, k, v, slots, layer=0, inplace=False):
    out = np.array(pool, dtype=np.float64)
    flat_slots = out.shape[2] * out.shape[3]
    for n, slot in enumerate(slots):
        if slot < 0:
            continue
        b, s = divmod(n, k.shape[2])
        block, offset = divmod(int(slot), out.shape[3])
        assert slot < flat_slots
        for h in range(k.shape[1]):
            out[layer, 0, block, offset, h] = k[b, h, s]
            out[layer, 1, block, offset, h] = v[b, h, s]
    return out


case(
    "paged_kv_write",
    lambda rng: [
        S(
            [r(rng, 2, 2, 3, 2, 2, 4), r(rng, 1, 2, 4, 4), r(rng, 1, 2, 4, 4), np.array([4, -1, 0, 5])],
            {"layer": 1},
        ),
        S(
            [r(rng, 1, 2, 2, 4, 1, 3), r(rng, 3, 1, 1, 3), r(rng, 3, 1, 1, 3), np.array([7, 2, 3])],
            {"inplace": True},
        ),
    ],
    _paged_write_ref,
)


def _paged_attention_ref(q, pool, tables, kv_len, q_start=None, q_len=None, layer=0, scale=None):
    b, hq, s, d = q.shape
    bs, hk = pool.shape[3], pool.shape[4]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, hq, s, d))
    segs = len(kv_len)
    starts = range(b * s) if q_start is None else q_start
    lens = [1] * segs if q_len is None else q_len
    for i in range(segs):
        t = int(kv_len[i])
        keys = [pool[layer, 0].reshape(-1, hk, d)[_slot_of(tables[i], p, bs)] for p in range(t)]
        vals = [pool[layer, 1].reshape(-1, hk, d)[_slot_of(tables[i], p, bs)] for p in range(t)]
        for j in range(int(lens[i])):
            row, col = divmod(int(starts[i]) + j, s)
            pos = t - int(lens[i]) + j  # the query's own position: it sees keys 0..pos
            for h in range(hq):
                kh = h // (hq // hk)
                sc = np.array([q[row, h, col] @ keys[p][kh] * scale for p in range(pos + 1)])
                w = np.exp(sc - sc.max())
                out[row, h, col] = sum(w[p] * vals[p][kh] for p in range(pos + 1)) / w.sum()
    return out


case(
    "paged_attention",
    lambda rng: [
        # decode: every token a segment (two sequences, 3 and 4 cached keys)
        S(
            [r(rng, 2, 4, 1, 3), r(rng, 2, 2, 5, 2, 2, 3), np.array([[4, 1], [0, 3]]), np.array([3, 4])],
            {"layer": 1},
        ),
        # prefill: two segments of one flattened row (the second a chunk after 2 cached keys), scale given
        S(
            [
                r(rng, 1, 2, 5, 3),
                r(rng, 1, 2, 4, 2, 1, 3),
                np.array([[2, 0, 1], [3, 1, 0]]),
                np.array([2, 5]),
                np.array([0, 2]),
                np.array([2, 3]),
            ],
            {"scale": 0.4},
        ),
    ],
    _paged_attention_ref,
)


def _paged_attention_grad_ref(g, q, pool, tables, kv_len, q_start=None, q_len=None, layer=0, scale=None):
    """From the attention backward per query token: with p the softmax of s_j = q.k_j * scale,
    dp_j = g.v_j, ds_j = p_j (dp_j - sum_i p_i dp_i); dq = scale sum_j ds_j k_j, dk_j += scale ds_j q,
    dv_j += p_j g, each key and value at its slot of the pool."""
    b, hq, s, d = q.shape
    bs, hk = pool.shape[3], pool.shape[4]
    scale = 1 / math.sqrt(d) if scale is None else scale
    dq, dpool = np.zeros(q.shape), np.zeros(pool.shape)
    keys_all, vals_all = pool[layer, 0].reshape(-1, hk, d), pool[layer, 1].reshape(-1, hk, d)
    dk_all, dv_all = dpool[layer, 0].reshape(-1, hk, d), dpool[layer, 1].reshape(-1, hk, d)  # views
    starts = range(b * s) if q_start is None else q_start
    lens = [1] * len(kv_len) if q_len is None else q_len
    for i in range(len(kv_len)):
        t = int(kv_len[i])
        slots = [_slot_of(tables[i], p, bs) for p in range(t)]
        for j in range(int(lens[i])):
            row, col = divmod(int(starts[i]) + j, s)
            pos = t - int(lens[i]) + j
            for h in range(hq):
                kh = h // (hq // hk)
                sc = np.array([q[row, h, col] @ keys_all[slots[p], kh] * scale for p in range(pos + 1)])
                w = np.exp(sc - sc.max())
                w /= w.sum()
                dp = np.array([g[row, h, col] @ vals_all[slots[p], kh] for p in range(pos + 1)])
                ds = w * (dp - (w * dp).sum())
                for p in range(pos + 1):
                    dq[row, h, col] += scale * ds[p] * keys_all[slots[p], kh]
                    dk_all[slots[p], kh] += scale * ds[p] * q[row, h, col]
                    dv_all[slots[p], kh] += w[p] * g[row, h, col]
    return dq, dpool


case(
    "paged_attention_grad",
    lambda rng: [
        S(
            [
                r(rng, 2, 4, 1, 3),
                r(rng, 2, 4, 1, 3),
                r(rng, 2, 2, 5, 2, 2, 3),
                np.array([[4, 1], [0, 3]]),
                np.array([3, 4]),
            ],
            {"layer": 1},
        ),
        # two sequences' prefill in one row: the second after 2 cached keys; a third whose keys
        # share the first's blocks (their key gradients add up)
        S(
            [
                r(rng, 1, 2, 7, 3),
                r(rng, 1, 2, 7, 3),
                r(rng, 1, 2, 4, 2, 1, 3),
                np.array([[2, 0, 1], [3, 1, 0], [2, 0, 1]]),
                np.array([2, 5, 3]),
                np.array([0, 2, 5]),
                np.array([2, 3, 2]),
            ],
            {"scale": 0.4},
        ),
    ],
    _paged_attention_grad_ref,
)


# ---- collectives (ops/collective.py): every rank on its own thread of the sim backend -------------


def _rows(rng, n, *shape):  # each rank's input, stacked
    return np.asarray(rng.standard_normal((n, *shape)))


case(
    "reshard",  # on plain tensors the identity; tests/framework/distributed covers the moves
    lambda rng: [
        S([r(rng, 3, 4)], {"mesh": dist.ProcessMesh((2,)), "placements": ["S(0)"]}),
        S([r(rng, 2, 3)], {"mesh": dist.ProcessMesh((2, 2)), "placements": ["R", "P(sum)"]}),
    ],
    lambda x, mesh, placements: x * 1,
)
case(
    "reshard_like",  # x's value in like's layout (reshard's gradient); on plain tensors the identity
    lambda rng: [S([r(rng, 3, 4), r(rng, 3, 4)]), S([r(rng, 2, 3, 2), r(rng, 2, 3, 2)])],
    lambda x, like: x * 1,
)
case(
    "all_reduce",
    lambda rng: [
        S([_rows(rng, 3, 2, 3)], {"group": [0, 1, 2]}),
        S([_rows(rng, 3, 4)], {"group": [2, 0, 1], "reduce": "max"}),
        S([_rows(rng, 3, 4)], {"group": [0, 1, 2], "reduce": "avg"}),
    ],
    lambda rank, x, group, reduce="sum", mesh=None: {"sum": np.sum, "max": np.max, "avg": np.mean}[reduce](
        x, axis=0
    ),
    ranks=3,
)
_UNEVEN = [np.zeros((3, 2, 4)), np.zeros((3, 1, 4)), np.zeros((3, 0, 4))]


def _gather_samples(rng):
    ragged = [rng.standard_normal((2, 4)), rng.standard_normal((1, 4)), rng.standard_normal((0, 4))]
    return [
        S([_rows(rng, 3, 2, 3)], {"group": [0, 1, 2], "axis": 1, "sizes": [3, 3, 3]}),
        S([ragged], lambda rank: {"group": [0, 1, 2], "axis": 0, "sizes": [2, 1, 0]}),
    ]


case(
    "all_gather",
    _gather_samples,
    lambda rank, x, group, axis, sizes, mesh=None: np.concatenate([x[g] for g in group], axis=axis),
    ranks=3,
)
case(
    "reduce_scatter",
    lambda rng: [
        S(
            [_rows(rng, 3, 5, 2)],
            lambda rank: {"group": [0, 1, 2], "axis": 0, "sizes": [2, 2, 1], "rank": rank},
        ),
        S(
            [_rows(rng, 3, 2, 3)],
            lambda rank: {"group": [0, 1, 2], "axis": 1, "sizes": [1, 2, 0], "rank": rank, "reduce": "min"},
        ),
    ],
    lambda rank, x, group, axis, sizes, rank_=None, mesh=None, reduce="sum", **kw: np.split(
        {"sum": np.sum, "min": np.min}[reduce](x, axis=0), np.cumsum(sizes)[:-1], axis=axis
    )[group.index(rank)],
    ranks=3,
)


def _a2a_ref(rank, x, group, split_axis, split_sizes, concat_axis, concat_sizes, mesh=None, **kw):
    i = group.index(rank)
    pieces = [np.split(x[g], np.cumsum(split_sizes)[:-1], axis=split_axis)[i] for g in group]
    return np.concatenate(pieces, axis=concat_axis)


case(
    "all_to_all",
    lambda rng: [
        S(
            [_rows(rng, 3, 2, 7)],  # [2, 7] per rank: dim 1 cut into 3, 2, 2; dim 0 gathered
            lambda rank: {
                "group": [0, 1, 2],
                "split_axis": 1,
                "split_sizes": [3, 2, 2],
                "concat_axis": 0,
                "concat_sizes": [2, 2, 2],
                "rank": rank,
            },
        )
    ],
    _a2a_ref,
    ranks=3,
)
case(
    "send",  # a ring: each rank sends to the next (and receives what the previous one sent)
    lambda rng: [S([_rows(rng, 3, 2, 3)], lambda rank: {"peer": (rank + 1) % 3})],
    lambda rank, x, peer, mesh=None: x[rank],
    ranks=3,
    after=lambda rank, attrs: dist.get_backend().recv((rank - 1) % 3, rank, (2, 3), np.float64),
)


def _recv_payload(rank):
    return np.arange(6.0).reshape(2, 3) + 10 * rank


case(
    "recv",
    lambda rng: [S([], lambda rank: {"peer": (rank - 1) % 3, "shape": [2, 3], "dtype": "float64"})],
    lambda rank, peer, shape, dtype, mesh=None: _recv_payload(peer),
    ranks=3,
    before=lambda rank, attrs: dist.get_backend().send(rank, (rank + 1) % 3, _recv_payload(rank)),
)


# ---- quantized linears (ops/quant.py) -----------------------------------------------------------


def _codes(rng, out, n_in, bits):
    """Random codes and their packed qweight, packed here from the format's text."""
    if bits == 8:
        q = rng.integers(-127, 128, (out, n_in))
        return q, q.astype(np.int8)
    q = rng.integers(0, 16, (out, n_in))
    return q, (q[:, 0::2] + 16 * q[:, 1::2]).astype(np.uint8)  # column 2j low nibble, 2j+1 high


def _dequant_ref(qweight, scales, zeros=None, bits=4, group_size=128):
    out, n_in = qweight.shape[0], qweight.shape[1] * (2 if bits == 4 else 1)
    w = np.zeros((out, n_in))
    for n in range(out):
        for c in range(n_in):
            if bits == 8:
                q = int(qweight[n, c])
            else:
                lo, hi = int(qweight[n, c // 2]) % 16, int(qweight[n, c // 2]) // 16
                q = hi if c % 2 else lo
            g = 0 if group_size == -1 else c // group_size
            zero = 0 if bits == 8 else (8 if zeros is None else int(zeros[n, g]))
            w[n, c] = (q - zero) * float(scales[n, g])
    return w


def _quant_samples(rng, with_x):
    """(bits, out, in, group_size, zeros?) settings: per channel, groups with a shorter last one."""
    out = []
    for bits, o, i, g, asym in [
        (8, 3, 5, -1, False),
        (8, 2, 6, 4, False),
        (4, 3, 10, 4, False),
        (4, 2, 8, -1, True),
    ]:
        _, qw = _codes(rng, o, i, bits)
        groups = 1 if g == -1 else -(-i // g)
        ins = [qw, pos(rng, o, groups)] + (
            [rng.integers(0, 16, (o, groups)).astype(np.uint8)] if asym else []
        )
        k = len(ins) + with_x
        keep = tuple((j, ax) for j in range(with_x, k) for ax in (0, 1))
        attrs = {"bits": bits, "group_size": g}
        if with_x:
            for x, rows in ((r(rng, 2, 3, i), 2), (r(rng, 1, i), 0)):
                kx = keep + ((0, x.ndim - 1),)  # the input width is the weight's (static)
                out.append(S([x, *ins], {**attrs, "rows": rows}, keep=kx))
        else:
            out.append(S(ins, attrs, keep=keep))
    return out


case("dequantize", lambda rng: _quant_samples(rng, False), _dequant_ref)
case(
    "quant_linear",
    lambda rng: _quant_samples(rng, True),
    lambda x, qw, s, z=None, bits=4, group_size=128, rows=0: np.einsum(
        "...i,oi->...o", x, _dequant_ref(qw, s, z, bits, group_size)
    ),
)


def _quants_samples(rng):
    """Two or three weights of one x (out 3, 2, 4), with and without zeros."""
    out = []
    for bits, g, asym, outs in [(8, 4, False, (3, 2)), (4, 4, False, (3, 2, 4)), (4, -1, True, (2, 3))]:
        x, ins = r(rng, 2, 8), []
        for o in outs:
            groups = 1 if g == -1 else -(-8 // g)
            ins += [_codes(rng, o, 8, bits)[1], pos(rng, o, groups)]
            ins += [rng.integers(0, 16, (o, groups)).astype(np.uint8)] if asym else []
        keep = ((0, 1), *((j, ax) for j in range(1, len(ins) + 1) for ax in (0, 1)))
        out.append(S([x, *ins], {"bits": bits, "group_size": g, "rows": 1, "zeros": asym}, keep=keep))
    return out


def _quants_ref(x, *ws, bits=4, group_size=128, rows=0, zeros=False):
    k = 3 if zeros else 2
    return tuple(
        np.einsum("...i,oi->...o", x, _dequant_ref(*ws[i : i + k], bits=bits, group_size=group_size))
        for i in range(0, len(ws), k)
    )


case("quant_linears", _quants_samples, _quants_ref)

# ---- the walk -----------------------------------------------------------------------------------


def test_every_op_has_a_case():
    missing = sorted(set(table()) - set(CASES))
    stale = sorted(set(CASES) - set(table()))
    assert not missing, f"ops without checks in test_op_table.py: {missing}"
    assert not stale, f"cases for ops that no longer exist: {stale}"


def _tensor(a, grad=False, device=None):
    if a is None:
        return None
    return lf.tensor(a, dtype=a.dtype, requires_grad=grad, device=device)


def _call(name, inputs, attrs, grad=False, device=None):
    spec = table()[name]
    ts = [_tensor(a, grad and a is not None and np.issubdtype(a.dtype, np.floating), device) for a in inputs]
    return lf.ops.public(spec)(ts, **attrs) if spec.variadic else lf.ops.public(spec)(*ts, **attrs), ts


def _outs(out):
    return out if isinstance(out, tuple) else (out,)


def seed_of(name: str) -> int:
    """A seed per op that every process agrees on (``hash(str)`` changes with each interpreter),
    so a failing sample reproduces."""
    return zlib.crc32(name.encode())


def _attrs(s, rank=0):
    return s.attrs(rank) if callable(s.attrs) else s.attrs


def _call_ranks(name, inputs, s, grad=False):
    """A collective's sample on every rank (one thread each): {rank: output}."""
    c = CASES[name]

    def body(rank):
        attrs = _attrs(s, rank)
        if c.before is not None:
            c.before(rank, attrs)
        out, _ = _call(name, [None if a is None else a[rank] for a in inputs], attrs, grad)
        if c.after is not None:
            c.after(rank, attrs)
        return out

    return dist.run_ranks(range(c.ranks), body)


def _ref_attrs(s, rank):
    return {k: v for k, v in _attrs(s, rank).items() if k != "rank"}


def _samples(name):
    return CASES[name].samples(np.random.default_rng(seed_of(name)))


OPS = sorted(table())


_DIGEST = """
import hashlib, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import test_op_table as t
h = hashlib.sha256()
for name in t.OPS:
    for s in t._samples(name):
        for a in s.inputs:  # (a collective's sample may list each rank's array)
            for x in a if isinstance(a, list) else [a]:
                h.update(b"-" if x is None else np.ascontiguousarray(x).tobytes())
print(h.hexdigest())
"""


@pytest.mark.slow
def test_every_process_draws_the_same_samples():
    """A failure seen once reproduces: string hashing differs per interpreter, the samples must not."""
    here = os.path.dirname(os.path.abspath(__file__))
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        r = subprocess.run([sys.executable, "-c", _DIGEST, here], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        digests.add(r.stdout.strip())
    assert len(digests) == 1


@pytest.mark.parametrize("name", OPS)
def test_forward_matches_numpy_float64(name, device, assert_on_device):
    """Every op's kernel against its float64 formula: with numpy, and (the GPU twin) the same
    kernel with cupy, whose every output must stay on the GPU."""
    c = CASES[name]
    for s in _samples(name):
        if c.ranks > 1:
            if device != "cpu":
                pytest.skip(
                    "collectives: sim ranks are host threads (nccl: tests/framework/test_gpu_twins.py)"
                )
            for rank, out in _call_ranks(name, s.inputs, s).items():
                want = c.ref(rank, *s.inputs, **_ref_attrs(s, rank))
                np.testing.assert_allclose(
                    out.numpy(), want, rtol=c.rtol, atol=c.atol, err_msg=f"{name} {rank}"
                )
            continue
        out, _ = _call(name, s.inputs, s.attrs, device=device)
        assert_on_device(*_outs(out))
        ref = c.ref(*s.inputs, **s.attrs)
        if name == "dropout":
            x, p = s.inputs[0], s.attrs["p"]
            y = out.numpy()
            kept = y != 0
            np.testing.assert_allclose(y[kept], (x / (1 - p))[kept], rtol=1e-12)
            assert p == 0 or 0 < kept.mean() < 1
            continue
        for o, e in zip(_outs(out), ref if isinstance(ref, tuple) else (ref,)):
            np.testing.assert_allclose(
                o.numpy().astype(np.float64),
                np.asarray(e, np.float64),
                rtol=c.rtol,
                atol=c.atol,
                err_msg=f"{name} {s.attrs}",
            )


@pytest.mark.parametrize("name", OPS)
def test_forward_float32_close_to_float64(name):
    for s in _samples(name):
        if CASES[name].ranks > 1:
            ins32 = [[x.astype(np.float32) for x in a] for a in s.inputs]
            if ins32:  # recv has no inputs: its dtype is an attribute
                got, want = _call_ranks(name, ins32, s), _call_ranks(name, s.inputs, s)
                for rank in got:
                    assert got[rank].dtype == np.float32
                    np.testing.assert_allclose(
                        got[rank].numpy(), want[rank].numpy(), rtol=2e-4, atol=2e-5, err_msg=name
                    )
            continue
        ins32 = [a.astype(np.float32) if a is not None and a.dtype == np.float64 else a for a in s.inputs]
        attrs = dict(s.attrs)
        if name in ("full", "one_hot", "arange") and attrs.get("dtype") == "float64":
            attrs["dtype"] = "float32"
        if name == "cast" and attrs["dtype"] == "float64":
            continue
        out, _ = _call(name, ins32, attrs)
        out64, _ = _call(name, s.inputs, s.attrs)
        for o, e in zip(_outs(out), _outs(out64)):
            if o.dtype != np.float32:
                continue
            np.testing.assert_allclose(o.numpy(), e.numpy(), rtol=2e-4, atol=2e-5, err_msg=name)


LOW = (np.float32, lf.bfloat16)


@pytest.mark.parametrize("name", OPS)
def test_infer_meta_matches_kernel(name):
    spec = table()[name]
    for s in _samples(name):
        if CASES[name].ranks > 1:
            for rank, out in _call_ranks(name, s.inputs, s).items():
                metas = [Meta(a[rank].shape, a[rank].dtype) for a in s.inputs]
                m = spec.infer_meta(*metas, **spec.bind(_attrs(s, rank)))
                assert (tuple(m.shape), m.dtype) == (out.shape, out.dtype), f"{name} rank {rank}: {m}"
            continue
        for ins in (  # bfloat16: numpy (ml_dtypes) lifts it to float32 in matmul and with python floats
            s.inputs,
            *(
                [a.astype(dt) if a is not None and a.dtype == np.float64 else a for a in s.inputs]
                for dt in LOW
            ),
        ):
            attrs = spec.bind(s.attrs)
            metas = [Meta(a.shape, a.dtype) for a in ins if a is not None]
            arrays = [a for a in ins if a is not None]
            want = spec.infer_meta(*metas, **attrs)
            got = spec.kernel(np, *arrays, **attrs)
            for m, g in zip(want if spec.multi_output else (want,), got if spec.multi_output else (got,)):
                g = np.asarray(g)
                assert tuple(m.shape) == g.shape, f"{name}: infer_meta {m} vs kernel {g.shape}"
                assert m.dtype == g.dtype, f"{name}: infer_meta {m} vs kernel {g.dtype}"


@pytest.mark.parametrize("name", OPS)
def test_infer_meta_with_symbolic_dims(name):
    """Rename every static dim > 1 to a symbol: the inferred shape must evaluate to the real one."""
    spec = table()[name]
    for s in _samples(name):
        if not s.sym:
            continue
        arrays = [a if CASES[name].ranks == 1 else a[0] for a in s.inputs if a is not None]
        if not arrays:
            continue
        attrs = spec.bind(_attrs(s))
        names = {d: f"d{d}" for a in arrays for d in a.shape if d > 1}
        env = {v: k for k, v in names.items()}
        metas = [
            Meta([d if (i, ax) in s.keep else names.get(d, d) for ax, d in enumerate(a.shape)], a.dtype)
            for i, a in enumerate(arrays)
        ]
        want = spec.infer_meta(*metas, **attrs)
        real = spec.infer_meta(*[Meta(a.shape, a.dtype) for a in arrays], **attrs)
        for m, g in zip(want if spec.multi_output else (want,), real if spec.multi_output else (real,)):
            assert [sym.evaluate(d, env) for d in m.shape] == list(g.shape), f"{name}: {m} vs {g}"
            assert m.dtype == g.dtype


@pytest.mark.parametrize("name", sorted(n for n, s in table().items() if s.decompose is not None))
def test_decompose_matches_kernel(name):
    spec = table()[name]
    for s in _samples(name):
        out, ts = _call(name, s.inputs, s.attrs)
        dec = spec.decompose(*[t for t in ts if t is not None], **spec.bind(s.attrs))
        for o, d in zip(_outs(out), _outs(dec)):
            np.testing.assert_allclose(d.numpy(), o.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def _diff_inputs(spec, inputs):
    if spec.vjp is None:
        return []
    return [
        i
        for i, a in enumerate(inputs)
        if a is not None and i not in spec.nondiff and np.issubdtype(a.dtype, np.floating)
    ]


@pytest.mark.parametrize("name", OPS)
def test_gradient_matches_finite_differences(name, device, assert_on_device):
    """Each vjp against central differences (float64, on the host); the GPU twin takes the
    gradient with cupy, every gradient staying on the GPU."""
    spec = table()[name]
    if device != "cpu" and CASES[name].ranks > 1:
        pytest.skip("collectives: sim ranks are host threads (nccl: tests/framework/test_gpu_twins.py)")
    for s in _samples(name):
        if not s.fd:
            continue
        diff = _diff_inputs(spec, s.inputs)
        if not diff:
            continue
        rng = np.random.default_rng(0)
        out, ts = _call(name, s.inputs, s.attrs, grad=True, device=device)
        outs = [o for o in _outs(out) if np.issubdtype(o.dtype, np.floating)]
        weights = [rng.standard_normal(o.shape) for o in outs]

        def loss_np(inputs):
            with lf.no_grad():
                o2, _ = _call(name, inputs, s.attrs, device="cpu")
            fl = [o for o in _outs(o2) if np.issubdtype(o.dtype, np.floating)]
            return sum(float(np.sum(o.numpy() * w)) for o, w in zip(fl, weights))

        loss = None
        for o, w in zip(outs, weights):
            term = (o * lf.tensor(w, device=device)).sum()
            loss = term if loss is None else loss + term
        grads = lf.grad(loss, [ts[i] for i in diff], allow_unused=True)
        assert_on_device(*[g for g in grads if g is not None])
        eps = 1e-6
        for i, g in zip(diff, grads):
            num = np.zeros_like(s.inputs[i])
            for j in np.ndindex(*s.inputs[i].shape):
                plus = [a.copy() if a is not None else None for a in s.inputs]
                minus = [a.copy() if a is not None else None for a in s.inputs]
                plus[i][j] += eps
                minus[i][j] -= eps
                num[j] = (loss_np(plus) - loss_np(minus)) / (2 * eps)
            got = np.zeros_like(num) if g is None else g.numpy()
            np.testing.assert_allclose(got, num, rtol=1e-5, atol=1e-6, err_msg=f"{name} input {i} {s.attrs}")


@pytest.mark.parametrize("name", sorted(n for n, s in table().items() if s.vjp is None))
def test_ops_without_gradient_stop_it(name):
    """Ops with no vjp (comparisons, argmax, creation...) give outputs that do not require grad."""
    for s in _samples(name):
        if CASES[name].ranks > 1:
            outs = list(_call_ranks(name, s.inputs, s, grad=True).values())
        else:
            outs = _outs(_call(name, s.inputs, s.attrs, grad=True)[0])
        for o in outs:
            assert not o.requires_grad


# ---- the SPMD column: every op on distributed inputs of a 2x2 sim mesh -------------------------------

MESH = dist.ProcessMesh((2, 2), ["a", "b"])


def _random_placements(rng, a):
    """Two placements (one per mesh dim) for input array ``a``: replicated, sharded on any dim,
    or (floating inputs) a Partial sum or average."""
    one = [dist.Replicate()] + [dist.Shard(d) for d in range(a.ndim)]
    if np.issubdtype(a.dtype, np.floating):
        one += [dist.Partial("sum"), dist.Partial("avg")]
    return [one[i] for i in rng.integers(0, len(one), 2)]


def _sharded(a, ps, grad):
    t = dist.shard_tensor(lf.tensor(a, dtype=a.dtype), MESH, ps)
    return t.requires_grad_(grad)


@pytest.mark.parametrize("name", OPS)
def test_sharded_op_equals_the_unsharded_op(name):
    """Random placements of the inputs on a 2x2 mesh: outputs (and the gradients of sum(out * w))
    equal the op on plain tensors, in float64, to 1e-12. Per-rank collectives refuse loudly."""
    spec, c = table()[name], CASES[name]
    rng = np.random.default_rng(seed_of(name))
    if c.ranks > 1:  # ops of per-rank programs: a distributed tensor is the wrong input
        s = _samples(name)[0]
        if not s.inputs:
            return  # recv takes no tensor
        ins = [_sharded(a[0], [dist.Replicate()] * 2, False) for a in s.inputs]
        with pytest.raises(lf.ops.OpError, match="dist.reshard"):
            lf.ops.public(spec)(*ins, **_attrs(s))
        return
    for s in _samples(name):
        for _ in range(2):
            placements = [None if a is None else _random_placements(rng, a) for a in s.inputs]
            diff = set(_diff_inputs(spec, s.inputs)) if s.fd else set()
            plain_out, plain_in = _call(name, s.inputs, s.attrs, grad=bool(diff))
            ins = [
                None if a is None else _sharded(a, ps, i in diff)
                for i, (a, ps) in enumerate(zip(s.inputs, placements))
            ]
            out = (
                lf.ops.public(spec)(ins, **s.attrs) if spec.variadic else lf.ops.public(spec)(*ins, **s.attrs)
            )
            why = f"{name} {s.attrs} placements {placements}"
            for o, want in zip(_outs(out), _outs(plain_out)):
                if not ins:  # no inputs (full, arange): computed as plain tensors, replicated
                    assert o.is_concrete
                    continue
                o._data.check()
                got = dist.unshard(o).numpy()
                if name == "dropout":  # the same seed over the same whole shape: the same mask
                    np.testing.assert_array_equal(got, want.numpy(), err_msg=why)
                    continue
                np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12, err_msg=why)
            if not diff:
                continue
            floats = [
                (o, w) for o, w in zip(_outs(out), _outs(plain_out)) if np.issubdtype(o.dtype, np.floating)
            ]
            weights = [rng.standard_normal(o.shape) for o, _ in floats]
            loss = plain_loss = None
            for (o, p), w in zip(floats, weights):
                term, plain_term = (o * lf.tensor(w)).sum(), (p * lf.tensor(w)).sum()
                loss = term if loss is None else loss + term
                plain_loss = plain_term if plain_loss is None else plain_loss + plain_term
            got = lf.grad(loss, [ins[i] for i in sorted(diff)], allow_unused=True)
            want = lf.grad(plain_loss, [plain_in[i] for i in sorted(diff)], allow_unused=True)
            for i, g, w in zip(sorted(diff), got, want):
                if w is None:
                    continue
                np.testing.assert_allclose(
                    dist.unshard(g).numpy(),
                    w.numpy(),
                    rtol=1e-12,
                    atol=1e-12,
                    err_msg=f"{why}: grad of input {i}",
                )
