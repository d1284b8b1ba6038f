"""jit.split_phases: a traced forward + backward cut by outputs into F, B and W programs whose
chained runs give the whole program's outputs (checked against a float64 formula), with the
forward's saved activations as the residuals between them."""

from __future__ import annotations

import numpy as np

import llmkit.framework as lf
from llmkit.framework.autograd import grad
from llmkit.framework.executor import Executor
from llmkit.framework.jit import to_static
from llmkit.framework.jit.split import split_phases


def run_phases(phases, args):
    res, out = {}, {}
    for ph in phases:
        got = Executor(ph.program).run([args[i] if k == "arg" else res[i] for k, i in ph.inputs])
        for (k, i), a in zip(ph.outputs, got):
            (res if k == "res" else out)[i] = a
    return out


def test_forward_input_gradient_and_weight_gradient_as_three_programs():
    rng = np.random.default_rng(0)
    w = lf.Parameter(rng.standard_normal((3, 4)))

    def step(x, g):  # y = tanh(x w^T) * 2; its input and weight gradients for output gradient g
        y = lf.ops.tanh(lf.ops.linear(x, w)) * 2.0
        return (y, *grad([y], [x, w], [g]))

    x = lf.tensor(rng.standard_normal((5, 4)), requires_grad=True)
    g = lf.tensor(rng.standard_normal((5, 3)))
    cp = to_static(step, compiler="none").get_concrete_program(x, g)
    f, b, wgt = split_phases(cp.program, [[0], [1], [2]])
    assert [k for k, _ in f.inputs] == ["arg", "arg"]  # x and the captured w; no gradient
    assert ("arg", 1) not in f.inputs and ("arg", 1) in b.inputs
    assert any(k == "res" for k, _ in f.outputs) and any(k == "res" for k, _ in b.inputs)
    assert all(op.name != "llm.tanh" for op in b.program.function().body)  # never recomputed
    args = [x.numpy(), g.numpy(), w.numpy()]
    out = run_phases([f, b, wgt], args)
    xa, ga, wa = args
    t = np.tanh(xa @ wa.T)
    dz = ga * 2.0 * (1 - t**2)
    np.testing.assert_allclose(out[0], 2 * t, rtol=1e-12)
    np.testing.assert_allclose(out[1], dz @ wa, rtol=1e-12)
    np.testing.assert_allclose(out[2], dz.T @ xa, rtol=1e-12)


def test_an_output_of_an_earlier_phase_and_constants():
    """A later phase may return what an earlier one computed (it passes through as a residual);
    ops without operands are copied, never held."""
    rng = np.random.default_rng(1)

    def f(x):
        a = lf.ops.exp(x) + 1.0
        return a, a * lf.ops.full([2], 3.0, dtype="float64")

    x = lf.tensor(rng.standard_normal(2))
    cp = to_static(f, compiler="none").get_concrete_program(x)
    p0, p1 = split_phases(cp.program, [[0], [1, 0]])
    out = run_phases([p0, p1], [x.numpy()])
    np.testing.assert_allclose(out[0], np.exp(x.numpy()) + 1, rtol=1e-12)
    np.testing.assert_allclose(out[1], 3 * (np.exp(x.numpy()) + 1), rtol=1e-12)
    assert p1.inputs == [("res", 0)]  # a, from phase 0; the constant 3 is its own
