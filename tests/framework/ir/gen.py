"""Random PIR programs drawn from the op table (for round-trip, verifier and pass tests).

``random_program(rng, n_ops)`` builds a function over a fixed pool of inputs by repeatedly
picking an op-table op, operands of the pool and attributes from per-type candidate lists, and
keeping the op when ``infer_meta`` accepts it. ``instantiate(spec, rng, pool)`` does one op.
Nothing here lists ops: new ops are covered as long as their attribute types have candidates.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np

from llmkit.framework import ir
from llmkit.framework.ops.views import END
from llmkit.framework.opspec import OpError, OpSpec, table
from llmkit.framework.placement import ProcessMesh

# name, type, how to draw test values
INPUTS: list[tuple[str, ir.TensorType]] = [
    ("a", ir.TensorType([2, 3], "float32")),
    ("b", ir.TensorType([3, 2], "float32")),
    ("c", ir.TensorType([2, 3, 4], "float32")),
    ("v", ir.TensorType([3], "float32")),
    ("q", ir.TensorType([1, 2, 3, 4], "float32")),
    ("t", ir.TensorType([3, 4], "float32")),
    ("s", ir.TensorType([], "float32")),
    ("i", ir.TensorType([2, 3], "int64")),
    ("p", ir.TensorType([1, 3], "int64")),
    ("m", ir.TensorType([2, 3], "bool")),
    ("d", ir.TensorType([2, 3], "float64")),
    ("r", ir.TensorType([1, 3], "float32")),
    ("k", ir.TensorType([2], "int64")),
]


def input_arrays(rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for _, t in INPUTS:
        shape = tuple(int(d) for d in t.shape)
        if t.dtype == np.bool_:
            out.append(rng.random(shape) < 0.5)
        elif t.dtype.kind == "i":  # zeros: a valid index into any axis
            out.append(np.zeros(shape, t.dtype))
        else:
            out.append(rng.standard_normal(shape).astype(t.dtype))
    return out


_BY_TYPE: dict[str, list[Any]] = {
    "int": [-1, 0, 1, 2, 3],
    "int?": [None, 0, -1, 1],
    "float": [0.0, 0.5, 1e-6, 2.0],
    "float?": [None, 0.5],
    "bool": [False, True],
    "str": ["none", "tanh", "mean", "sum"],
    "dtype": ["float32", "float64", "int64", "bool", "int32"],
    "dtype?": [None, "float32", "float64"],
    "dim": [0, 1, 2, 3],
    "dim?": [None, 2, 3, 4],
    "axes": [None, (0,), (-1,), (0, 1), (1,)],
    "num_or_sections": [1, 2, 3, (1, 2), (2, 1), (1, 1)],
    "mesh": [
        ProcessMesh((2,), ["x"]),
        ProcessMesh((2, 2), ["dp", "tp"]),
        ProcessMesh((2,), ["y"], ranks=[3, 1]),
    ],
    "mesh?": [None, ProcessMesh((1,), ["x"])],
    "placements": [
        ("R",),
        ("S(0)",),
        ("S(-1)",),
        ("P(sum)",),
        ("R", "S(1)"),
        ("S(0)", "P(max)"),
        ("S(0)", "S(0)"),
    ],
}


def _shapes(x: Any) -> list[tuple]:
    if x is None:
        return [(2, 3), (3,), ()]
    s = tuple(x.shape)
    return [s, (-1,), s[::-1], (1, *s), (2, -1), (-1, 1), (2, 2, *s), tuple(1 if d == 1 else d for d in s)]


def _ints(x: Any) -> list[tuple]:
    nd = x.ndim if x is not None else 2
    perms = list(itertools.permutations(range(nd))) if nd <= 4 else [tuple(range(nd))]
    return [*perms, (0,), (1,), (-1,), (0, 1), (1, 2), (2,), (END,)]


def draw_attrs(spec: OpSpec, rng: random.Random, operands: list) -> dict[str, Any]:
    x = operands[0] if operands else None
    out: dict[str, Any] = {}
    for a in spec.attrs:
        t = a.type.name
        has_default = a.name in spec._defaults
        if has_default and rng.random() < 0.4:
            continue
        if t == "shape":
            choices = _shapes(x)
        elif t == "ints":
            choices = _ints(x)
        else:
            choices = _BY_TYPE.get(t)
            if choices is None:
                if has_default:
                    continue
                raise LookupError(f"no test values for attribute type {t!r}")
        out[a.name] = rng.choice(choices)
    return out


def instantiate(
    b: ir.Builder, spec: OpSpec, rng: random.Random, pool: list[ir.Value], tries: int = 60
) -> ir.Operation | None:
    """One op of ``spec`` over values of ``pool`` (None when no draw type-checks)."""
    for _ in range(tries):
        n = rng.randint(1, 3) if spec.variadic else rng.randint(spec.min_inputs, spec.max_inputs)
        operands = [rng.choice(pool) for _ in range(n)]
        if n > 1:  # most ops want operands alike: draw them from the first one's type half the time
            same = [v for v in pool if v.type == operands[0].type]
            operands = [operands[0]] + [rng.choice(same) if rng.random() < 0.5 else v for v in operands[1:]]
        try:
            attrs = draw_attrs(spec, rng, operands)
            # every op must also run: interpreter kernels need a static, modest size
            op = b.create(spec, operands, attrs, insert=False)
        except (OpError, ir.IRError, TypeError, ValueError, ZeroDivisionError, IndexError):
            continue
        if not all(
            isinstance(r.type, ir.TensorType) and r.type.is_static and np.prod(r.type.shape) <= 4096
            for r in op.results
        ):
            op.erase(drop_uses=True)
            continue
        b.insert(op)
        return op
    return None


# Ops that give different values on each run would make equality checks meaningless; none exist
# in the op table today (dropout draws from its seed attribute), so nothing is excluded.
# Ops the canonicalize, fold and fusion rules look at (random_program(ops=REWRITABLE) hits them).
REWRITABLE = [
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "exp",
    "silu",
    "matmul",
    "transpose",
    "reshape",
    "cast",
    "expand",
    "squeeze",
    "slice",
    "concat",
    "full",
    "zeros_like",
    "ones_like",
    "maximum",
]


def _constants(b: ir.Builder, rng: random.Random) -> list[ir.Value]:
    """Splat ones and zeros, a scalar one and random constants, for the folding rules to find."""
    r = np.random.default_rng(rng.randrange(2**32))
    return [
        b.constant(np.ones((2, 3), np.float32)),
        b.constant(np.zeros((2, 3), np.float32)),
        b.constant(np.float32(1.0)),
        b.constant(r.standard_normal((2, 3)).astype(np.float32)),
        b.constant(r.standard_normal(3).astype(np.float32)),
        b.constant(np.zeros((), np.float32)),
    ]


def random_program(
    rng: random.Random, n_ops: int, ops: list[str] | None = None, constants: bool = False
) -> ir.Program:
    """A verified program of up to ``n_ops`` random op-table ops (drawn from ``ops``, default
    all), returning every new value; ``constants`` adds a few constants to draw operands from."""
    p = ir.Program()
    f = p.add_function("main", INPUTS)
    b = ir.Builder.at_end(f.body)
    pool: list[ir.Value] = list(f.args) + (_constants(b, rng) if constants else [])
    names = ops or sorted(table())
    made: list[ir.Value] = []
    for _ in range(n_ops):
        op = instantiate(b, table()[rng.choice(names)], rng, pool, tries=10)
        if op is not None:
            pool.extend(op.results)
            made.extend(op.results)
    b.ret(*made)
    return p
