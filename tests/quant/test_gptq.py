"""GPTQ on synthetic layers: exact where it must reduce to round-to-nearest, better where inputs correlate."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.quant import Hessian, QuantConfig, QuantError, gptq, quantize_rtn
from llmkit.quant.gptq import _inverse_factor

from .test_format import read_weight

CONFIGS = [
    QuantConfig(8, -1, True, "gptq"),
    QuantConfig(4, 128, True, "gptq"),
    QuantConfig(4, 32, True, "gptq"),
    QuantConfig(4, 32, False, "gptq"),
]


def correlated_inputs(rng, n, d):
    """Inputs with a few strong directions and very unequal column scales (as activations have)."""
    basis = rng.standard_normal((8, d)) * rng.uniform(0.5, 4, (8, 1))
    return rng.standard_normal((n, 8)) @ basis + 0.1 * rng.standard_normal((n, d)) * rng.uniform(0.1, 3, d)


def test_hessian_is_two_xtx_over_n_across_batches():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 5, 16)), rng.standard_normal((7, 16))]
    h = Hessian(16)
    for x in xs:
        h.add(x.astype(np.float32))
    flat = np.concatenate([x.reshape(-1, 16).astype(np.float32).astype(np.float64) for x in xs])
    np.testing.assert_allclose(h.value(), 2 * flat.T @ flat / len(flat), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("act_order", [False, True])
def test_with_uncorrelated_inputs_gptq_is_round_to_nearest(cfg, act_order):
    """A diagonal Hessian propagates no error: every column is rounded on its own, as RTN does."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 160)).astype(np.float32)
    h = np.diag(rng.uniform(0.5, 2.0, 160))
    got, want = gptq(w, h, cfg, act_order=act_order), quantize_rtn(w, cfg)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_output_error_of_correlated_inputs(cfg, act_order):
    rng = np.random.default_rng(2)
    d = 160  # groups of 32 and a shorter last group of 128 (160 = 128 + 32)
    x = correlated_inputs(rng, 2048, d)
    w = rng.standard_normal((48, d)).astype(np.float32)
    h = Hessian(d)
    h.add(x[:1024])
    g = cfg.group_size

    def err(qw):
        return np.sum((x[1024:] @ (w - read_weight(*qw, cfg.bits, g)).T) ** 2)  # held-out inputs

    rtn, ours = err(quantize_rtn(w, cfg)), err(gptq(w, h.value(), cfg, act_order=act_order))
    assert ours < 0.25 * rtn, (ours, rtn)  # (0.006-0.04 here: the inputs span a few directions)


def test_inputs_that_are_always_zero_get_zero_weights():
    rng = np.random.default_rng(3)
    x = correlated_inputs(rng, 512, 64)
    x[:, [5, 40]] = 0.0
    h = Hessian(64)
    h.add(x)
    cfg = QuantConfig(4, 32, False, "gptq")
    w = read_weight(*gptq(rng.standard_normal((8, 64)), h.value(), cfg), 4, 32)
    assert np.all(w[:, [5, 40]] == 0)


def ill_conditioned_hessian(rng, n=128, top=3400.0):
    """A positive semi-definite ``H`` like a late linear's (one direction ~1e4 times the rest) with the
    asymmetry its float32 Gram blocks give (``Hᵢⱼ − Hⱼᵢ`` ~1e-7 relative; seen on an AMD EPYC host)."""
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    h = (q * np.concatenate([[top], rng.uniform(0.0, 0.5, n - 1)])) @ q.T
    e = rng.standard_normal((n, n)) * 4e-7 * top
    return (h + h.T) / 2 + (e - e.T) / 2


@pytest.mark.parametrize("act_order", [False, True])
def test_a_slightly_asymmetric_hessian_quantizes_as_its_symmetric_part(act_order):
    # inv(H) amplified the asymmetry past the smallest eigenvalue of H⁻¹: cholesky(inv(H)) raised
    rng = np.random.default_rng(5)
    h = ill_conditioned_hessian(rng)
    sym = (h + h.T) / 2
    assert np.abs(h - h.T).max() > 0
    cfg, w = QuantConfig(4, 32, True, "gptq"), rng.standard_normal((16, 128))
    got = read_weight(*gptq(w, h, cfg, act_order=act_order), 4, 32)
    np.testing.assert_array_equal(got, read_weight(*gptq(w, sym, cfg, act_order=act_order), 4, 32))
    # ... and GPTQ used the factor of the damped inverse: UᵀU = (H + λI)⁻¹ in float64
    u = _inverse_factor(h, 0.01)
    ref = np.linalg.inv(sym + 0.01 * np.mean(np.diag(sym)) * np.eye(128))
    np.testing.assert_allclose(u.T @ u, ref, rtol=1e-8, atol=1e-12 * np.abs(ref).max())
    assert np.allclose(u, np.triu(u))


def test_an_indefinite_hessian_gets_more_damping_and_a_non_finite_one_a_clear_error():
    rng = np.random.default_rng(6)
    q, _ = np.linalg.qr(rng.standard_normal((64, 64)))
    h = (q * np.concatenate([[-0.05], np.ones(63)])) @ q.T  # mean diag ~1: damping 0.01 is not enough
    cfg, w = QuantConfig(4, 32, True, "gptq"), rng.standard_normal((8, 64))
    assert np.isfinite(read_weight(*gptq(w, h, cfg), 4, 32)).all()
    with pytest.raises(QuantError, match=r"\[64x64\] .* not positive definite even with damping 100 x mean"):
        gptq(w, h - 2 * np.eye(64), cfg)
    h[3, 7] = h[7, 3] = np.nan
    with pytest.raises(QuantError, match="the Hessian has 2 non-finite entries"):
        gptq(w, h, cfg)
