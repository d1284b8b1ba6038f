"""Schedules against their closed forms; clip_grad_norm_ against numpy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import optim


def make_opt(lrs=(1.0, 0.1)) -> optim.SGD:
    return optim.SGD([{"params": [lf.Parameter(lf.zeros(1))], "lr": lr} for lr in lrs], lr=lrs[0])


def cosine(s, warmup, total, floor):
    if s < warmup:
        return (s + 1) / warmup
    q = min(1.0, (s - warmup) / (total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * q))


def linear(s, warmup, total, end):
    if s < warmup:
        return (s + 1) / warmup
    return 1 - (1 - end) * min(1.0, (s - warmup) / (total - warmup))


@pytest.mark.parametrize(
    ("make", "formula"),
    [
        (
            lambda o: optim.WarmupCosine(o, warmup_steps=5, total_steps=30, min_lr_ratio=0.1),
            lambda s: cosine(s, 5, 30, 0.1),
        ),
        (
            lambda o: optim.LinearDecay(o, warmup_steps=3, total_steps=20, end_ratio=0.2),
            lambda s: linear(s, 3, 20, 0.2),
        ),
        (lambda o: optim.ConstantLR(o, warmup_steps=4), lambda s: min(1.0, (s + 1) / 4)),
        (lambda o: optim.ConstantLR(o), lambda s: 1.0),
    ],
)
def test_schedules_match_their_closed_forms(make, formula):
    opt = make_opt()
    sched = make(opt)
    for s in range(40):  # past total_steps: the schedules stay at their floor
        assert sched.get_lr() == pytest.approx([formula(s), 0.1 * formula(s)], rel=1e-12)
        assert [g["lr"] for g in opt.param_groups] == sched.get_lr()
        sched.step()


def test_schedule_endpoints():
    opt = make_opt((2.0,))
    sched = optim.WarmupCosine(opt, warmup_steps=10, total_steps=110, min_lr_ratio=0.0)
    assert sched.get_lr() == [pytest.approx(0.2)]  # the first step already trains
    for _ in range(9):
        sched.step()
    assert sched.get_lr() == [pytest.approx(2.0)]
    for _ in range(101):
        sched.step()
    assert sched.get_lr() == [pytest.approx(0.0, abs=1e-15)]
    with pytest.raises(ValueError, match="total_steps"):
        optim.LinearDecay(opt, warmup_steps=5, total_steps=4)


def test_schedule_state_dict_round_trips_through_json():
    a_opt, b_opt = make_opt(), make_opt()
    a = optim.WarmupCosine(a_opt, 3, 50, 0.05)
    for _ in range(17):
        a.step()
    b = optim.WarmupCosine(b_opt, 1, 2, 0.5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    assert [g["lr"] for g in b_opt.param_groups] == [g["lr"] for g in a_opt.param_groups]
    with pytest.raises(ValueError, match="from a WarmupCosine"):
        optim.LinearDecay(make_opt(), 1, 2).load_state_dict(a.state_dict())
    assert repr(a) == "WarmupCosine(warmup_steps=3, total_steps=50, min_lr_ratio=0.05, step=17)"


@pytest.mark.parametrize(("max_norm", "dtype"), [(0.5, "float64"), (100.0, "float64"), (1.0, "float32")])
def test_clip_grad_norm_matches_numpy(max_norm, dtype):
    rng = np.random.default_rng(0)
    params = [lf.Parameter(lf.zeros(*s, dtype=dtype)) for s in [(3, 4), (5,), ()]]
    grads = [rng.standard_normal(p.shape) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = lf.tensor(g, dtype=dtype)
    params.append(lf.Parameter(lf.zeros(2, dtype=dtype)))  # no grad: skipped
    norm = optim.clip_grad_norm_(params, max_norm)
    ref = math.sqrt(sum((g**2).sum() for g in grads))
    assert isinstance(norm, lf.Tensor) and norm.shape == ()
    tol = 1e-12 if dtype == "float64" else 1e-6
    assert norm.item() == pytest.approx(ref, rel=tol)
    scale = min(1.0, max_norm / (ref + 1e-6))
    for p, g in zip(params[:3], grads, strict=True):
        np.testing.assert_allclose(p.grad.numpy(), g * scale, rtol=tol)
    assert params[3].grad is None
    clipped = math.sqrt(sum((p.grad.numpy().astype(np.float64) ** 2).sum() for p in params[:3]))
    assert clipped <= max_norm * (1 + tol)


def test_clip_grad_norm_with_no_grads_and_half_precision():
    assert optim.clip_grad_norm_([lf.Parameter(lf.zeros(2))], 1.0).item() == 0.0
    p = lf.Parameter(lf.zeros(4, dtype="bfloat16"))
    p.grad = lf.full([4], 300.0, dtype="bfloat16")  # the norm is accumulated in float32, not bf16
    assert optim.clip_grad_norm_(p, 1.0).item() == pytest.approx(600.0)
    assert p.grad.dtype == lf.bfloat16
    np.testing.assert_allclose(p.grad.numpy().astype(np.float32), 0.5, rtol=1e-2)
