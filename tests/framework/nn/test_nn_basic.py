"""Linear, Embedding, RMSNorm, Dropout, activations, containers, init and functional.

Forwards are checked against float64 numpy formulas written here; gradients against central
finite differences in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import llmkit.framework as lf
import llmkit.framework.nn.functional as F
from llmkit.framework import nn
from llmkit.framework.nn import init


def numeric_grad(f, t: lf.Tensor, eps: float = 1e-6) -> np.ndarray:
    """d f() / d t by central differences, perturbing t's values one element at a time."""
    base = t.numpy().copy()
    out = np.zeros_like(base)
    for i in np.ndindex(base.shape):
        for sign in (1, -1):
            v = base.copy()
            v[i] += sign * eps
            t.set_value(v)
            out[i] += sign * f().item() / (2 * eps)
    t.set_value(base)
    return out


def check_grads(layer: nn.Layer, x: lf.Tensor) -> None:
    """Every parameter's (and a floating input's) gradient of sum(layer(x) * r) against finite differences."""
    r = lf.randn(*layer(x).shape, dtype="float64")

    def loss() -> lf.Tensor:
        return (layer(x) * r).sum()

    for p in layer.parameters():
        p.grad = None
    targets = list(layer.parameters()) + ([x.requires_grad_()] if x.dtype == np.float64 else [])
    loss().backward()
    for t in targets:
        g = t.grad.numpy()
        with lf.no_grad():
            np.testing.assert_allclose(g, numeric_grad(loss, t), rtol=1e-6, atol=1e-8)


def test_linear_matches_numpy_and_its_gradients_match_finite_differences():
    lf.seed(0)
    layer = nn.Linear(5, 3, dtype="float64")
    assert layer.weight.shape == (3, 5) and layer.bias.shape == (3,)
    x = lf.randn(2, 4, 5, dtype="float64")
    w, b = layer.weight.numpy(), layer.bias.numpy()
    np.testing.assert_allclose(layer(x).numpy(), x.numpy() @ w.T + b, rtol=1e-12)
    check_grads(layer, x)
    no_bias = nn.Linear(5, 3, bias=False, dtype="float64")
    assert no_bias.bias is None and len(no_bias.parameters()) == 1
    check_grads(no_bias, lf.randn(4, 5, dtype="float64"))


def test_linear_init_is_pytorch_default_uniform():
    lf.seed(0)
    layer = nn.Linear(400, 300)
    bound = 1 / math.sqrt(400)
    w = layer.weight.numpy()
    assert w.dtype == np.float32 and np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.01 * bound
    assert np.abs(layer.bias.numpy()).max() <= bound
    lf.seed(0)
    np.testing.assert_array_equal(nn.Linear(400, 300).weight.numpy(), w)  # seeded


def test_embedding_matches_numpy_and_its_gradient_matches_finite_differences():
    lf.seed(0)
    layer = nn.Embedding(7, 3, dtype="float64")
    ids = lf.tensor([[0, 3, 3], [6, 1, 0]])
    np.testing.assert_array_equal(layer(ids).numpy(), layer.weight.numpy()[ids.numpy()])
    check_grads(layer, ids)


def test_embedding_padding_row_starts_at_zero_and_gets_no_gradient():
    lf.seed(0)
    layer = nn.Embedding(5, 2, padding_idx=-1, dtype="float64")
    assert layer.padding_idx == 4
    np.testing.assert_array_equal(layer.weight.numpy()[4], 0.0)
    ids = lf.tensor([4, 1, 4, 1])
    layer(ids).sum().backward()
    np.testing.assert_array_equal(layer.weight.grad.numpy()[4], 0.0)
    np.testing.assert_array_equal(layer.weight.grad.numpy()[1], 2.0)
    with pytest.raises(ValueError, match="padding_idx"):
        nn.Embedding(5, 2, padding_idx=5)


def test_rmsnorm_matches_numpy_and_its_gradients_match_finite_differences():
    lf.seed(0)
    layer = nn.RMSNorm(6, eps=1e-5, dtype="float64")
    layer.weight.set_value(lf.randn(6, dtype="float64"))
    x = lf.randn(2, 3, 6, dtype="float64")
    xn = x.numpy()
    ref = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-5) * layer.weight.numpy()
    np.testing.assert_allclose(layer(x).numpy(), ref, rtol=1e-12)
    check_grads(layer, x)
    assert (nn.RMSNorm(3).weight.numpy() == 1).all()


def test_dropout_layer_and_functional():
    lf.seed(0)
    x = lf.ones(2000)
    y = nn.Dropout(0.25)(x).numpy()
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.75)}
    assert abs((y == 0).mean() - 0.25) < 0.04
    assert F.dropout(x, 0.5, training=False) is x
    assert nn.Dropout(0.0)(x) is x
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        nn.Dropout(1.0)
    lf.seed(3)
    a = nn.Dropout(0.5)(x).numpy()
    lf.seed(3)
    np.testing.assert_array_equal(nn.Dropout(0.5)(x).numpy(), a)  # reproducible from lf.seed


def test_activations_match_numpy():
    x = lf.tensor([-2.0, -0.5, 0.0, 0.5, 3.0], dtype="float64")
    xn = x.numpy()
    np.testing.assert_allclose(nn.SiLU()(x).numpy(), xn / (1 + np.exp(-xn)), rtol=1e-12)
    np.testing.assert_allclose(nn.ReLU()(x).numpy(), np.maximum(xn, 0))
    erf = np.vectorize(math.erf)
    np.testing.assert_allclose(nn.GELU()(x).numpy(), 0.5 * xn * (1 + erf(xn / math.sqrt(2))), rtol=1e-12)
    tanh_ref = 0.5 * xn * (1 + np.tanh(math.sqrt(2 / math.pi) * (xn + 0.044715 * xn**3)))
    np.testing.assert_allclose(nn.GELU("tanh")(x).numpy(), tanh_ref, rtol=1e-12)


def test_sequential_and_containers():
    lf.seed(0)
    seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = lf.randn(5, 3)
    h = np.maximum(x.numpy() @ seq[0].weight.numpy().T + seq[0].bias.numpy(), 0)
    np.testing.assert_allclose(seq(x).numpy(), h @ seq[2].weight.numpy().T + seq[2].bias.numpy(), rtol=1e-5)
    assert len(seq) == 3 and isinstance(seq[-1], nn.Linear) and len(seq[1:]) == 2
    named = nn.Sequential({"proj": nn.Linear(3, 3), "act": nn.SiLU()})
    assert [n for n, _ in named.named_parameters()] == ["proj.weight", "proj.bias"]

    ll = nn.LayerList([nn.ReLU(), nn.SiLU()])
    ll.insert(0, nn.GELU())
    ll.append(nn.Linear(1, 1))
    assert [type(m).__name__ for m in ll] == ["GELU", "ReLU", "SiLU", "Linear"]
    del ll[1]
    assert [n for n, _ in ll.named_parameters()] == ["2.weight", "2.bias"]
    ll[0] = nn.Linear(2, 2)
    assert len(ll.parameters()) == 4 and nn.ModuleList is nn.LayerList
    with pytest.raises(IndexError):
        ll[5]

    ld = nn.LayerDict({"a": nn.Linear(1, 2)})
    ld["b"] = nn.ReLU()
    assert list(ld) == ["a", "b"] and "a" in ld and len(ld) == 2
    assert [n for n, _ in ld.named_parameters()] == ["a.weight", "a.bias"]
    ld.pop("a")
    assert ld.parameters() == []


def test_init_functions_follow_their_formulas():
    lf.seed(0)
    t = lf.empty(200, 300, dtype="float64")
    fan_in, fan_out = 300, 200
    r = math.sqrt(6 / (fan_in + fan_out))
    v = init.xavier_uniform_(t).numpy()
    assert np.abs(v).max() <= r and abs(v.std() - r / math.sqrt(3)) < 0.02 * r
    assert abs(init.xavier_normal_(t).numpy().std() - math.sqrt(2 / 500)) < 0.02 * math.sqrt(2 / 500)
    std = math.sqrt(2) / math.sqrt(fan_in)
    assert abs(init.kaiming_normal_(t, nonlinearity="relu").numpy().std() - std) < 0.02 * std
    std_out = math.sqrt(2) / math.sqrt(fan_out)
    assert (
        abs(init.kaiming_uniform_(t, mode="fan_out", nonlinearity="relu").numpy().std() - std_out)
        < 0.02 * std_out
    )
    v = init.trunc_normal_(t, mean=1.0, std=2.0, a=0.0, b=3.0).numpy()
    pdf = lambda z: math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    cdf = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
    lo, hi = (0.0 - 1.0) / 2.0, (3.0 - 1.0) / 2.0
    mean = 1.0 + 2.0 * (pdf(lo) - pdf(hi)) / (cdf(hi) - cdf(lo))  # the truncated normal's mean
    assert v.min() >= 0 and v.max() <= 3 and abs(v.mean() - mean) < 0.01
    v = init.normal_(t, 2.0, 0.5).numpy()
    assert abs(v.mean() - 2) < 0.01 and abs(v.std() - 0.5) < 0.01
    v = init.uniform_(t, -1.0, 3.0).numpy()
    assert v.min() >= -1 and v.max() < 3 and abs(v.mean() - 1) < 0.02
    assert (init.zeros_(t).numpy() == 0).all() and (init.ones_(t).numpy() == 1).all()
    assert (init.constant_(lf.empty(3, dtype="bfloat16"), 0.5).numpy() == 0.5).all()
    assert init.calculate_gain("leaky_relu", 0.2) == pytest.approx(math.sqrt(2 / 1.04))
    with pytest.raises(ValueError, match="at least 2 dims"):
        init.xavier_uniform_(lf.empty(3))
    with pytest.raises(ValueError, match="unknown nonlinearity"):
        init.calculate_gain("swish")


def test_init_keeps_identity_and_dtype():
    p = lf.Parameter(lf.zeros(4, 4, dtype="bfloat16"))
    assert init.kaiming_uniform_(p) is p and p.dtype == lf.bfloat16 and p.requires_grad


def test_functional_delegates_every_op_and_adds_wrappers():
    for name in set(lf.ops.table()) - set(F.__all__):
        assert getattr(F, name) is getattr(lf.ops, name)
    assert F.dropout is not lf.ops.dropout  # the wrapper (training switch, fresh seed) wins
    assert "softmax" in dir(F) and "dropout" in dir(F) and "pad" in dir(F)
    with pytest.raises(AttributeError, match="neither a wrapper here nor an op"):
        F.no_such_op  # noqa: B018


def test_pad_matches_numpy_and_differentiates():
    x = lf.randn(2, 3, dtype="float64", requires_grad=True)
    y = F.pad(x, (1, 2, 0, 1), value=-1.0)
    np.testing.assert_array_equal(y.numpy(), np.pad(x.numpy(), ((0, 1), (1, 2)), constant_values=-1.0))
    (y * y).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * x.numpy())
    assert F.pad(x, (0, 0)) is x
    with pytest.raises(ValueError, match="pairs"):
        F.pad(x, (1,))
    with pytest.raises(ValueError, match=">= 0"):
        F.pad(x, (-1, 0))
