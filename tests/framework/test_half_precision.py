"""Reductions over bfloat16 accumulate in float32: a running bfloat16 sum stops growing at 256 (8
bits of mantissa), so summing 1024 values near 1 in bfloat16 gives about 256, not 1024.

Each op runs on bfloat16 input and is compared with the same math in float64 numpy on the same
(bfloat16-rounded) values; the tolerance is a few bfloat16 roundings of the result (2^-8 relative
each).
"""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf

N = 1024  # reduced axis: four times the length at which a bfloat16 running sum saturates
RTOL = 3 * 2.0**-8


def _lse(x):
    m = x.max(axis=-1, keepdims=True)
    return np.log(np.exp(x - m).sum(axis=-1, keepdims=True)) + m


REFERENCE = {  # op -> (call on a Tensor, float64 formula on an array)
    "sum": (lambda t: lf.ops.sum(t, axis=-1), lambda x: x.sum(axis=-1)),
    "mean": (lambda t: lf.ops.mean(t, axis=-1), lambda x: x.mean(axis=-1)),
    "logsumexp": (lambda t: lf.ops.logsumexp(t, axis=-1), lambda x: _lse(x)[..., 0]),
    "softmax": (lambda t: lf.ops.softmax(t, axis=-1), lambda x: np.exp(x - _lse(x))),
    "log_softmax": (lambda t: lf.ops.log_softmax(t, axis=-1), lambda x: x - _lse(x)),
    "cross_entropy": (
        lambda t: lf.ops.cross_entropy(t, lf.tensor(np.arange(4) * 7)),
        lambda x: np.mean(_lse(x)[:, 0] - x[np.arange(4), np.arange(4) * 7]),
    ),
}


@pytest.mark.parametrize("op", list(REFERENCE))
def test_bfloat16_reductions_match_float64(op):
    x = np.random.default_rng(0).uniform(0.5, 1.5, size=(4, N)).astype(lf.bfloat16)
    call, formula = REFERENCE[op]
    got = call(lf.tensor(x))
    assert got.dtype == lf.bfloat16
    np.testing.assert_allclose(got.numpy().astype(np.float64), formula(x.astype(np.float64)), rtol=RTOL)
