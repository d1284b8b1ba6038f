"""The eager C fast path (``compiler/native/pyext.py``): exact twins of reference kernels, the
dispatch shortcut for cached signatures, and the fallback to the Python path."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import dispatch
from llmkit.framework.compiler import build
from llmkit.framework.compiler.native import pyext
from llmkit.framework.opspec import OpError, get

needs_ext = pytest.mark.skipif(dispatch._fast_apply is None, reason="no C compiler or Python.h here")


def _softmax64(x, axis):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _silu64(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return x / (1.0 + np.exp(-np.float64(x)))


def _cases():
    rng = np.random.default_rng(0)
    for dt in (np.float32, np.float64):
        masked = rng.standard_normal((3, 9)).astype(dt)
        masked[:, 5:] = -np.inf  # a causal mask's row
        yield masked, -1
        yield rng.standard_normal((3, 7)).astype(dt), -1
        yield (rng.standard_normal((2, 3, 300)) * 30).astype(dt), 2  # > 128: the pairwise sum's halves
        yield rng.standard_normal((2, 3, 129)).astype(dt), -1
        yield rng.standard_normal((5, 1)).astype(dt), -1  # 1-element rows
        yield rng.standard_normal(1).astype(dt), 0
        yield rng.standard_normal((4, 6)).astype(dt).T, -1  # not contiguous: the reference runs
        yield rng.standard_normal((4, 6)).astype(dt)[:, ::2], -1
        yield rng.standard_normal((4, 6)).astype(dt), 0  # another axis


@needs_ext
def test_the_twins_replace_the_kernels():
    for op in pyext.TWINS:
        assert get(op).kernel is not pyext.reference[op]


@needs_ext
@pytest.mark.parametrize("op", ["softmax", "silu"])
def test_twins_give_the_reference_kernels_bits(op):
    for x, axis in _cases():
        kw = {"axis": axis} if op == "softmax" else {}
        with np.errstate(invalid="ignore"):
            got, want = get(op).kernel(np, x, **kw), pyext.reference[op](np, x, **kw)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), (op, x.dtype, x.shape, axis)
        ref = _softmax64(x, axis) if op == "softmax" else _silu64(x)  # the formula, in float64
        tol = 1e-6 if x.dtype == np.float32 else 1e-14
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


@needs_ext
@pytest.mark.parametrize("op", ["softmax", "silu"])
def test_twins_leave_values_that_are_not_finite_to_the_reference(op):
    for dt in (np.float32, np.float64):
        x = np.array([[0.5, np.nan, 1.0], [np.inf, 0.0, 1.0], [-np.inf] * 3, [-np.inf, 2.0, 0.0]], dt)
        kw = {"axis": -1} if op == "softmax" else {}
        with np.errstate(invalid="ignore"):
            got, want = get(op).kernel(np, x, **kw), pyext.reference[op](np, x, **kw)
        assert got.tobytes() == want.tobytes()


def _nll64(x, labels):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(-1)) + m[..., 0]
    return lse - np.take_along_axis(x, np.maximum(labels, 0)[..., None], -1)[..., 0]


@needs_ext
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_cross_entropy_twin_gives_the_reference_kernels_bits(reduction):
    rng = np.random.default_rng(2)
    ce, ref = get("cross_entropy").kernel, pyext.reference["cross_entropy"]
    for dt in (np.float32, np.float64):
        for shape in [(4, 4), (3, 7), (2, 3, 11), (20, 300), (9, 1)]:
            x = (rng.standard_normal(shape) * 10).astype(dt)
            x.reshape(-1)[0] = -np.inf if shape[-1] > 1 else 0.0  # a masked logit
            labels = rng.integers(0, shape[-1], shape[:-1])
            for ignored in (False, True):
                if ignored:
                    labels.reshape(-1)[::2] = -100
                got, want = ce(np, x, labels, reduction=reduction), ref(np, x, labels, reduction=reduction)
                assert type(got) is type(want) and got.dtype == want.dtype and np.shape(got) == np.shape(want)
                assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), (dt, shape, ignored)
                nll = np.where(labels != -100, _nll64(x, labels), 0.0)  # the formula, in float64
                n = max(int((labels != -100).sum()), 1)
                ref64 = {"none": nll, "sum": nll.sum(), "mean": nll.sum() / n}[reduction]
                tol = 1e-5 if dt == np.float32 else 1e-12
                np.testing.assert_allclose(got, ref64, rtol=tol, atol=tol)
    x = np.zeros((3, 4), np.float32)  # label smoothing, a label out of range, every label ignored
    assert ce(np, x, np.array([0, 1, 2]), label_smoothing=0.1) == ref(
        np, x, np.array([0, 1, 2]), label_smoothing=0.1
    )
    with pytest.raises(IndexError):
        ce(np, x, np.array([0, 4, 1]), reduction=reduction)
    with np.errstate(invalid="ignore"):
        got = ce(np, x, np.full(3, -100), reduction=reduction)
        want = ref(np, x, np.full(3, -100), reduction=reduction)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@needs_ext
def test_cached_calls_give_the_python_paths_tensors(monkeypatch):
    rng = np.random.default_rng(1)
    x = lf.tensor(rng.standard_normal((4, 5)).astype(np.float32))
    y = lf.tensor(rng.standard_normal((4, 5)).astype(np.float32))
    w = lf.tensor(rng.standard_normal((5, 3)).astype(np.float32))
    labels = lf.tensor(np.array([0, 4, 2, 1], np.int64))
    F = lf.ops
    calls = [
        lambda: x + y,
        lambda: x @ w,
        lambda: F.softmax(x, axis=0),
        lambda: F.silu(x),
        lambda: F.cross_entropy(x, labels),  # a 0-d result
        lambda: F.sum(x, axis=-1),
    ]
    fast = [[c() for _ in range(3)] for c in calls]  # the first call fills the cache
    assert dispatch._fast_apply(get("add"), (x, y), {}) is not None  # a cached signature: the C path
    monkeypatch.setattr(dispatch, "_fast_apply", None)
    for ts, c in zip(fast, calls):
        slow = c()
        for t in ts:
            assert type(t) is lf.Tensor and not t.requires_grad and t.grad is None and t._node is None
            assert t.name is None and t._out_idx == 0 and type(t._data) is np.ndarray
            assert t.dtype == slow.dtype and t.shape == slow.shape
            assert t.numpy().tobytes() == slow.numpy().tobytes()


@needs_ext
def test_the_c_path_declines_what_python_must_do():
    x = lf.tensor(np.ones((2, 3), np.float32))
    xg = lf.tensor(np.ones((2, 3), np.float32), requires_grad=True)
    add = get("add")
    x + x, xg + x
    assert dispatch._fast_apply(add, (x, x), {}) is not None
    assert dispatch._fast_apply(add, (xg, x), {}) is None  # a gradient to record
    assert dispatch._fast_apply(add, (x, 2.0), {}) is None  # a number to lift
    assert dispatch._fast_apply(add, (x, lf.tensor(np.ones(7, np.float32))), {}) is None  # not seen yet
    assert (xg + x)._node is not None
    with dispatch.profiling() as table:
        x + x
    assert table["llm.add"][1] == 1


@needs_ext
def test_errors_are_the_same_on_every_call():
    a = lf.tensor(np.ones((2, 3), np.float32))
    b = lf.tensor(np.ones(4, np.float32))
    logits = lf.tensor(np.zeros((2, 4), np.float32))
    lf.ops.cross_entropy(logits, lf.tensor(np.array([1, 2], np.int64)))  # the signature is cached
    for _ in range(3):
        with pytest.raises(OpError, match="add"):
            a + b
        with pytest.raises(OpError, match="softmax"):
            lf.ops.softmax(a, axis=5)
        with pytest.raises(OpError, match="axis"):
            lf.ops.softmax(a, axis="last")
        with pytest.raises(OpError, match="cross_entropy: kernel failed"):  # the kernel's IndexError
            lf.ops.cross_entropy(logits, lf.tensor(np.array([1, 9], np.int64)))


def test_no_extension_without_a_compiler_or_python_h(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMKIT_EAGER_EXT", "0")
    assert pyext.load() is None
    monkeypatch.delenv("LLMKIT_EAGER_EXT")
    monkeypatch.setattr(build, "_toolchain", None)
    assert pyext.load() is None
    monkeypatch.undo()
    monkeypatch.setattr(pyext.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert pyext.load() is None


@pytest.mark.slow
def test_a_process_without_a_compiler_computes_the_same_bits():
    code = (
        "import numpy as np, llmkit.framework as lf\n"
        "from llmkit.framework import dispatch\n"
        "assert dispatch._fast_apply is None\n"
        "x = lf.tensor(np.linspace(-3, 3, 40, dtype=np.float32).reshape(4, 10))\n"
        "for _ in range(2):\n"
        "    print((lf.ops.softmax(x, axis=-1).numpy().tobytes() + lf.ops.silu(x).numpy().tobytes()).hex())\n"
    )
    env = {**os.environ, "LLMKIT_CC": "none"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    x = lf.tensor(np.linspace(-3, 3, 40, dtype=np.float32).reshape(4, 10))
    here = (lf.ops.softmax(x, axis=-1).numpy().tobytes() + lf.ops.silu(x).numpy().tobytes()).hex()
    assert out.stdout.split() == [here, here]
