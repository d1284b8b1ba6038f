"""Eager kernels on their fast paths (small arrays, ``ndarray.dot`` for matrices) give the numbers of
the plain numpy formulas written here: close to float64, and bit for bit the float32/float64
formula numpy computes step by step (what the training losses depend on)."""

import numpy as np
import pytest

import llmkit.framework as lf


def _softmax_steps(x, axis):
    """Softmax as numpy computes it in x's dtype, one step at a time."""
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _softmax_rows(dtype):
    x = np.array(
        [
            [0.5, -1.0, 2.0, 0.25],
            [-np.inf, 3.0, -np.inf, 1.0],  # masked entries: exp gives exact zeros
            [1e4, 1e4 - 1.0, -1e4, 0.0],  # large values: only the shift keeps exp finite
            [-7.0, -7.0, -7.0, -7.0],
        ],
        dtype,
    )
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_matches_the_float64_formula_and_numpys_steps(dtype):
    x = _softmax_rows(dtype)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    ref = e / e.sum(axis=-1, keepdims=True)
    got = lf.ops.softmax(lf.tensor(x), axis=-1).numpy()
    assert got.dtype == dtype
    np.testing.assert_allclose(got, ref, rtol=1e-6 if dtype == np.float32 else 1e-14, atol=0)
    assert got[1, 0] == 0.0 and got[1, 2] == 0.0
    np.testing.assert_array_equal(got, _softmax_steps(x, -1))
    for axis in (0, 1):  # every axis, bit for bit
        np.testing.assert_array_equal(
            lf.ops.softmax(lf.tensor(x[:, :3]), axis=axis).numpy(), _softmax_steps(x[:, :3], axis)
        )
    one = lf.ops.softmax(lf.tensor(x[:, 1:2]), axis=-1).numpy()  # 1-element rows: exactly 1
    np.testing.assert_array_equal(one, np.ones((4, 1), dtype))
    rng = np.random.default_rng(0)
    big = (rng.standard_normal((3, 300)) * 20).astype(dtype)  # past numpy's 8-wide pairwise blocks
    np.testing.assert_array_equal(lf.ops.softmax(lf.tensor(big)).numpy(), _softmax_steps(big, -1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_gives_numpys_matmul_bits(dtype):
    rng = np.random.default_rng(1)
    shapes = [((4, 4), (4, 4)), ((3, 5), (5, 7)), ((1, 4), (4, 3)), ((4, 1), (1, 4)), ((5, 2), (2, 1))]
    shapes += [((64, 300), (300, 17)), ((2, 3, 8), (8, 5)), ((0, 3), (3, 2))]
    for sx, sy in shapes:
        x, y = rng.standard_normal(sx).astype(dtype), rng.standard_normal(sy).astype(dtype)
        got = (lf.tensor(x) @ lf.tensor(y)).numpy()
        flat = np.matmul(x.reshape(-1, sx[-1]), y).reshape(got.shape)  # [..., K] @ [K, N]: one GEMM
        np.testing.assert_array_equal(got, flat)
        np.testing.assert_allclose(got, x.astype(np.float64) @ y.astype(np.float64), rtol=1e-4, atol=1e-4)
    x, y = rng.standard_normal((6, 4)).astype(dtype), rng.standard_normal((5, 4)).astype(dtype)
    got = lf.ops.matmul(lf.tensor(x), lf.tensor(y), transpose_y=True).numpy()
    np.testing.assert_array_equal(got, np.matmul(x, y.T))
    sliced = rng.standard_normal((6, 8)).astype(dtype)[:, ::2]  # not contiguous
    np.testing.assert_array_equal((lf.tensor(sliced) @ lf.tensor(y.T)).numpy(), np.matmul(sliced, y.T))
