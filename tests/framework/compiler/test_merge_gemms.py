"""``merge-gemms``: linears of one input and their backward run as one GEMM each, with the gradients
of the separate products (checked against a float64 numpy formula)."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import jit
from llmkit.framework.compiler import merge_gemms
from llmkit.framework.dispatch import O

from .conftest import needs_cc

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 5, 4)).astype(np.float32)
S = RNG.standard_normal(4).astype(np.float32)
WS = [RNG.standard_normal((n, 4)).astype(np.float32) for n in (3, 2, 6)]


def _step():
    s, ws = lf.Parameter(S), [lf.Parameter(w) for w in WS]

    def step(x):
        h = x * s
        a, b, c = (O.linear(h, w) for w in ws)
        loss = O.tanh(a).sum() + (b * b).sum() + (c * O.tanh(c)).sum()
        return (loss, *lf.grad(loss, [s, *ws]))

    return jit.to_static(step, input_spec=[jit.InputSpec(["B", "S", 4])], compiler="cinn")


def _reference():
    """Loss and gradients (s, W1, W2, W3) in float64."""
    x, s, ws = X.astype(np.float64), S.astype(np.float64), [w.astype(np.float64) for w in WS]
    h = x * s
    a, b, c = (h @ w.T for w in ws)
    loss = np.tanh(a).sum() + (b * b).sum() + (c * np.tanh(c)).sum()
    gs = [1 - np.tanh(a) ** 2, 2 * b, np.tanh(c) + c * (1 - np.tanh(c) ** 2)]
    dh = sum(g @ w for g, w in zip(gs, ws))
    dws = [g.reshape(-1, g.shape[-1]).T @ h.reshape(-1, 4) for g in gs]
    return [loss, (dh * x).sum(axis=(0, 1)), *dws]


@needs_cc
def test_linears_of_one_input_merge_and_keep_their_gradients():
    run = _step()
    out = run(lf.tensor(X))
    program = run.get_concrete_program(lf.tensor(X)).program.clone()
    assert merge_gemms.merge_gemms(program) == 1
    ops = [op.name for op in program.walk()]
    assert ops.count("llm.linear") == 1 and ops.count("llm.matmul") == 2  # was 3 and 6
    for got, want in zip(out, _reference()):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=1e-5)


def test_linears_without_their_backward_stay_apart():
    ws = [lf.Parameter(w) for w in WS]
    run = jit.to_static(lambda x: [O.linear(x, w) for w in ws], input_spec=[jit.InputSpec(["B", 4])])
    program = run.get_concrete_program(lf.tensor(X[0])).program.clone()
    assert merge_gemms.merge_gemms(program) == 0
    assert [op.name for op in program.walk()].count("llm.linear") == 3


@pytest.mark.parametrize("on", [False, True])
@needs_cc
def test_switch(monkeypatch, on):
    """LLMKIT_MERGE_GEMMS=0 (``merge_gemms.enabled``) compiles the separate products."""
    monkeypatch.setattr(merge_gemms, "enabled", on)
    run = _step()
    run(lf.tensor(X))
    names = [s.name for s in run._last.executor.steps]
    assert sum(n.startswith("llm.matmul") for n in names) == (
        3 if on else 9
    )  # forward, input and weight gradients
