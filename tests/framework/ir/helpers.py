"""Shared helpers for the PIR tests (random inputs for a function, output comparison)."""

from __future__ import annotations

import numpy as np

from llmkit.framework import ir, symbolic


def symbol_sizes(func: ir.FuncOp, size: int = 3) -> dict[str, int]:
    """Every symbol in a function's types, each bound to ``size``."""
    types = [a.type for a in func.args] + [r.type for op in func.walk() for r in op.results]
    return {s: size for t in types for d in t.shape for s in symbolic.symbols(d)}


def inputs_for(
    func: ir.FuncOp, rng: np.random.Generator, env: dict[str, int] | None = None
) -> list[np.ndarray]:
    """Random arrays for a function's inputs, sized by ``env`` (default: every symbol is 3).

    Floats are standard normal, integers zero (a valid index anywhere), bools random.
    """
    env = symbol_sizes(func) if env is None else env
    out = []
    for a in func.args:
        shape = tuple(symbolic.evaluate(d, env) for d in a.type.shape)
        dt = a.type.dtype
        if dt == np.bool_:
            out.append(rng.random(shape) < 0.5)
        elif dt.kind in "iu":
            out.append(np.zeros(shape, dt))
        else:
            out.append(rng.standard_normal(shape).astype(dt))
    return out


def assert_same_outputs(a, b, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Two interpreter results agree (tuples elementwise; NaNs in the same places)."""
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, x.dtype, y.shape, y.dtype)
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)
