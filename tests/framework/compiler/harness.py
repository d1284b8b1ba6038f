"""Shared helpers: trace a function once with symbolic dims, fuse it, build every kernel in one go,
then compare the compiled program with the unfused reference on many concrete inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import llmkit.framework as lf
from llmkit.framework import compiler, ir, jit
from llmkit.framework.executor import Executor


@dataclass
class Case:
    """A function of tensors, its symbolic input specs and a maker of concrete inputs."""

    name: str
    fn: Callable
    specs: list  # (shape with symbols, dtype-or-"f") per input; "f" is the float dtype under test
    make: Callable[[np.random.Generator, np.dtype, dict], list]  # (rng, float dtype, sizes) -> arrays
    sizes: list[dict] = field(default_factory=list)  # symbol bindings to run with
    grad: tuple[int, ...] = ()  # inputs the function differentiates (they get requires_grad)


@dataclass
class Built:
    case: Case
    dtype: np.dtype
    reference: ir.Program  # the traced program, unfused
    fused: ir.Program


def trace(case: Case, dtype: np.dtype) -> ir.Program:
    specs = [jit.InputSpec(s, dtype if d == "f" else d) for s, d in case.specs]
    sample = case.make(
        np.random.default_rng(0), dtype, {k: 2 for s, _ in case.specs for k in s if isinstance(k, str)}
    )
    ts = [lf.tensor(a, dtype=a.dtype, requires_grad=i in case.grad) for i, a in enumerate(sample)]
    sf = jit.to_static(case.fn, input_spec=specs, compiler="none")
    return sf.get_concrete_program(*ts).program


def build_all(cases: list[Case], dtypes: list) -> list[Built]:
    """Trace and fuse every case, then build all their kernels with one compiler run."""
    out = []
    for c in cases:
        for dt in dtypes:
            ref = trace(c, np.dtype(dt))
            out.append(Built(c, np.dtype(dt), ref, compiler.fuse_program(ref)))
    compiler.compile_fusions(*[b.fused for b in out])
    return out


def run(program: ir.Program, arrays: list, native: bool = False) -> list:
    """Run ``program``; ``native=True`` as compiled programs run (the ops' hand-written kernels too),
    else with the reference kernels (what compiled programs are checked against)."""
    return Executor(program, native=native).run(arrays)


def assert_same(got: list, want: list, dtype: np.dtype, what: str = "") -> None:
    """Equal where the reference is NaN or inf (same pattern); close elsewhere."""
    rtol, atol = (1e-11, 1e-12) if dtype == np.float64 else (2e-5, 2e-6)
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (what, k, g.shape, w.shape, g.dtype, w.dtype)
        if w.dtype.kind != "f":
            np.testing.assert_array_equal(g, w, err_msg=f"{what} output {k}")
            continue
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{what} output {k}: NaN positions")
        inf = np.isinf(w)
        np.testing.assert_array_equal(g[inf], w[inf], err_msg=f"{what} output {k}: inf values")
        fin = np.isfinite(w)
        scale = np.max(np.abs(w[fin]), initial=0.0)
        np.testing.assert_allclose(
            g[fin], w[fin], rtol=rtol, atol=atol * max(1.0, scale), err_msg=f"{what} output {k}"
        )


def count_kernels(program: ir.Program) -> tuple[int, int]:
    """(fusion groups, groups with a compiled kernel)."""
    from llmkit.framework.compiler.runtime import _KERNELS

    groups = [op for op in program.walk() if op.name == "cinn.fusion"]
    return len(groups), sum(1 for g in groups if g in _KERNELS)


def count_native(program: ir.Program) -> tuple[int, int]:
    """(ops whose hand-written kernel applies, steps a native executor runs with one)."""
    from llmkit.framework.compiler.native import native_of

    ops = sum(1 for op in program.walk() if native_of(op) is not None)
    return ops, sum(1 for st in Executor(program, native=True).steps if st.name.endswith("[native]"))
