"""Compiled programs' products as row blocks on the kernels' threads (``native/products.py``): the
values of a float64 product, forward and weight gradient; small products keep one BLAS call."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import jit
from llmkit.framework.compiler.native import products
from llmkit.framework.dispatch import O

from .conftest import needs_cc

pytestmark = [needs_cc, pytest.mark.skipif(products.CPUS < 2, reason="one kernel thread: BLAS as it is")]


@pytest.fixture(autouse=True)
def row_products(monkeypatch):
    monkeypatch.setattr(products, "enabled", True)  # as with LLMKIT_SPLIT_GEMMS=1 (off by default)


@pytest.mark.parametrize("rows", [300, 7])
def test_products_run_in_row_blocks_with_the_float64_values(rows):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    w = lf.Parameter(rng.standard_normal((200, 256)).astype(np.float32))

    def step(x):
        y = O.linear(x, w)
        return y, lf.grad((y * y).sum(), [w])[0]

    run = jit.to_static(step, input_spec=[jit.InputSpec(["N", 256])], compiler="cinn")
    y, gw = run(lf.tensor(x))
    x64, w64 = x.astype(np.float64), w.numpy().astype(np.float64)
    np.testing.assert_allclose(y.numpy(), x64 @ w64.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gw.numpy(), 2 * (x64 @ w64.T).T @ x64, rtol=1e-5, atol=1e-2)
    names = [s.name for s in run._last.executor.steps if s.name.startswith("llm.matmul")]
    assert names == ["llm.matmul[rows]"] * 2  # the forward and the weight gradient
    calls = []
    real = products.matmul_rows
    products.matmul_rows = lambda *a: calls.append(a) or real(*a)
    try:
        run(lf.tensor(x))
    finally:
        products.matmul_rows = real
    assert len(calls) == (2 if rows == 300 else 0)  # 7 rows: too small a product, one BLAS call


def _linear_and_weight_grad(seed: int, tokens: int, out: int):
    """A ``[tokens, 256]`` input, a ``[out, 256]`` weight, and a step: the linear's output and the
    weight's gradient of ``sum(y * y)``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, 256)).astype(np.float32)
    w = lf.Parameter(rng.standard_normal((out, 256)).astype(np.float32))

    def step(x):
        y = O.linear(x, w)
        return y, lf.grad((y * y).sum(), [w])[0]

    return x, w, step


def test_long_mode_splits_only_the_long_reductions(monkeypatch):
    """``LLMKIT_SPLIT_GEMMS=long``: the weight gradient (a sum over 1100 tokens) in row blocks, the
    forward (a sum over 256 features) one BLAS call as it is; both the float64 values."""
    monkeypatch.setattr(products, "mode", "long")
    x, w, step = _linear_and_weight_grad(1, 1100, 200)
    run = jit.to_static(step, input_spec=[jit.InputSpec(["N", 256])], compiler="cinn")
    calls = []
    real = products.matmul_rows
    monkeypatch.setattr(products, "matmul_rows", lambda a, *r: calls.append(a.shape) or real(a, *r))
    y, gw = run(lf.tensor(x))
    x64, w64 = x.astype(np.float64), w.numpy().astype(np.float64)
    np.testing.assert_allclose(y.numpy(), x64 @ w64.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gw.numpy(), 2 * (x64 @ w64.T).T @ x64, rtol=1e-5, atol=5e-2)
    assert calls == [(200, 1100)]  # the weight gradient's rows: [out_features, tokens] @ [tokens, in]


def test_a_compiled_step_s_bits_do_not_depend_on_the_row_blocks_schedule(monkeypatch):
    """A stopped and resumed run equals the whole one only if a step's bits never follow the load:
    the forward and weight gradient under three forced schedules of their row blocks, bit for bit."""
    import time

    from llmkit.framework import blas

    x, _w, step = _linear_and_weight_grad(3, 520, 136)
    run = jit.to_static(step, input_spec=[jit.InputSpec([520, 256])], compiler="cinn")
    delay = np.random.default_rng(4)
    hooks = {
        "caller_late": lambda helper: helper or time.sleep(0.01),  # helpers take most blocks
        "helper_late": lambda helper: helper and time.sleep(0.01),  # the caller takes most
        "random": lambda helper: time.sleep(delay.uniform(0, 0.003)),
    }
    bits = set()
    for hook in hooks.values():
        monkeypatch.setattr(blas, "_claim_hook", hook)
        y, gw = run(lf.tensor(x))
        bits.add((y.numpy().tobytes(), gw.numpy().tobytes()))
    assert len(bits) == 1
