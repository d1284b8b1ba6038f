"""SGD and AdamW against float64 numpy references (and torch.optim when installed); groups; resuming."""

from __future__ import annotations

import json

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import optim

STEPS = 6


def grads_for(step: int, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Deterministic, varied gradients for each step (the references see the same ones)."""
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(s) for s in shapes]


def make_params(shapes: list[tuple[int, ...]], dtype: str = "float64") -> list[lf.Parameter]:
    rng = np.random.default_rng(7)
    return [lf.Parameter(lf.tensor(rng.standard_normal(s), dtype=dtype)) for s in shapes]


def run(opt: optim.Optimizer, params: list[lf.Parameter], steps: int = STEPS, start: int = 0) -> None:
    for t in range(start, start + steps):
        for p, g in zip(params, grads_for(t, [p.shape for p in params]), strict=True):
            p.grad = lf.tensor(g, dtype=p.dtype)
        opt.step()


def sgd_reference(ps, lr, momentum, nesterov, wd, steps=STEPS):
    ps = [p.copy() for p in ps]
    bufs = [None] * len(ps)
    for t in range(steps):
        for i, g in enumerate(grads_for(t, [p.shape for p in ps])):
            g = g + wd * ps[i]
            if momentum:
                bufs[i] = g.copy() if bufs[i] is None else momentum * bufs[i] + g  # PyTorch: first buffer = g
                g = g + momentum * bufs[i] if nesterov else bufs[i]
            ps[i] = ps[i] - lr * g
    return ps


def adamw_reference(ps, lr, b1, b2, eps, wd, steps=STEPS):
    ps = [p.copy() for p in ps]
    m = [np.zeros_like(p) for p in ps]
    v = [np.zeros_like(p) for p in ps]
    for t in range(1, steps + 1):
        for i, g in enumerate(grads_for(t - 1, [p.shape for p in ps])):
            ps[i] = ps[i] - lr * wd * ps[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat, vhat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            ps[i] = ps[i] - lr * mhat / (np.sqrt(vhat) + eps)
    return ps


SHAPES = [(3, 4), (4,), ()]


@pytest.mark.parametrize(
    ("momentum", "nesterov", "wd"),
    [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 0.01), (0.5, False, 0.1)],
)
def test_sgd_matches_numpy_reference(momentum, nesterov, wd):
    params = make_params(SHAPES)
    init = [p.numpy().copy() for p in params]
    run(optim.SGD(params, lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd), params)
    for p, ref in zip(params, sgd_reference(init, 0.1, momentum, nesterov, wd), strict=True):
        np.testing.assert_allclose(p.numpy(), ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("betas", "eps", "wd"), [((0.9, 0.999), 1e-8, 0.01), ((0.8, 0.95), 1e-3, 0.0), ((0.0, 0.5), 1e-8, 0.3)]
)
def test_adamw_matches_numpy_reference(betas, eps, wd):
    params = make_params(SHAPES)
    init = [p.numpy().copy() for p in params]
    run(optim.AdamW(params, lr=0.05, betas=betas, eps=eps, weight_decay=wd), params)
    for p, ref in zip(params, adamw_reference(init, 0.05, *betas, eps, wd), strict=True):
        np.testing.assert_allclose(p.numpy(), ref, rtol=1e-12, atol=1e-14)


def test_float32_params_keep_their_dtype_and_stay_close_to_the_reference():
    params = make_params(SHAPES, "float32")
    init = [p.numpy().astype(np.float64) for p in params]
    opt = optim.AdamW(params, lr=0.05)
    run(opt, params)
    assert all(p.dtype == np.float32 for p in params)
    for p, ref in zip(params, adamw_reference(init, 0.05, 0.9, 0.999, 1e-8, 0.01), strict=True):
        np.testing.assert_allclose(p.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_bfloat16_params_get_float32_state():
    params = make_params([(8,)], "bfloat16")
    opt = optim.AdamW(params, lr=0.01)
    run(opt, params, steps=2)
    assert params[0].dtype == lf.bfloat16
    state = opt.state_dict()["state"][0]
    assert state["exp_avg"].dtype == np.float32 and state["exp_avg_sq"].dtype == np.float32
    assert np.isfinite(params[0].numpy().astype(np.float32)).all()


def test_parameter_groups_override_defaults():
    a, b = make_params([(3,)]), make_params([(3,)])
    a0, b0 = a[0].numpy().copy(), b[0].numpy().copy()
    opt = optim.SGD([{"params": a}, {"params": b, "lr": 0.5, "momentum": 0.9}], lr=0.1)
    assert opt.param_groups[1]["lr"] == 0.5 and opt.param_groups[0]["momentum"] == 0.0
    assert [sorted(s) for s in opt._state] == [[], ["momentum_buffer"]]
    for t in range(STEPS):
        g = grads_for(t, [(3,)])[0]  # both parameters see the gradient the one-parameter reference sees
        a[0].grad, b[0].grad = lf.tensor(g), lf.tensor(g)
        opt.step()
    np.testing.assert_allclose(a[0].numpy(), sgd_reference([a0], 0.1, 0.0, False, 0.0)[0], rtol=1e-12)
    np.testing.assert_allclose(b[0].numpy(), sgd_reference([b0], 0.5, 0.9, False, 0.0)[0], rtol=1e-12)


def test_lr_changes_between_steps_are_picked_up():
    params = make_params([(2,)])
    p0 = params[0].numpy().copy()
    opt = optim.SGD(params, lr=1.0)
    params[0].grad = lf.ones(2, dtype="float64")
    opt.param_groups[0]["lr"] = 0.25
    opt.step()
    np.testing.assert_allclose(params[0].numpy(), p0 - 0.25)
    opt.param_groups[0]["lr"] = lf.tensor(0.5)  # a tensor lr works too
    opt.step()
    np.testing.assert_allclose(params[0].numpy(), p0 - 0.75)
    assert opt.step_count.item() == 2 and opt.step_count.dtype == np.int64


def test_parameters_without_grad_are_skipped_and_zero_grad_clears():
    params = make_params([(2,), (2,)])
    before = params[1].numpy().copy()
    opt = optim.AdamW(params)
    params[0].grad = lf.ones(2, dtype="float64")
    opt.step()
    np.testing.assert_array_equal(params[1].numpy(), before)
    opt.zero_grad(set_to_none=False)
    assert (params[0].grad.numpy() == 0).all() and params[1].grad is None
    opt.zero_grad()
    assert params[0].grad is None


def test_bad_arguments_are_clear_errors():
    p = make_params([(2,)])
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.AdamW([])
    with pytest.raises(ValueError, match="nesterov"):
        optim.SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        optim.AdamW(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="unknown hyperparameters \\['momentum'\\]"):
        optim.AdamW([{"params": p, "momentum": 0.9}])
    with pytest.raises(ValueError, match="appears twice"):
        optim.SGD([{"params": p}, {"params": p}], lr=0.1)
    with pytest.raises(TypeError, match="floating"):
        optim.SGD([lf.Parameter(lf.tensor([1, 2]))], lr=0.1)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "lr": 0.02}]),
        lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    ],
)
def test_state_dict_save_load_into_a_fresh_optimizer_continues_bit_identically(make, tmp_path):
    full = make_params(SHAPES, "float32")
    opt = make(full)
    run(opt, full, steps=6)

    half = make_params(SHAPES, "float32")
    opt1 = make(half)
    run(opt1, half, steps=3)
    tensors, meta = optim.flatten_state_dict(opt1.state_dict())
    lf.save(
        {**tensors, **{f"param.{i}": p for i, p in enumerate(half)}},
        tmp_path / "ckpt.safetensors",
        metadata={"optimizer": json.dumps(meta)},
    )

    loaded = lf.load(tmp_path / "ckpt.safetensors")
    meta = json.loads(lf.serialization.load_metadata(tmp_path / "ckpt.safetensors")["optimizer"])
    resumed = make_params(SHAPES, "float32")
    for i, p in enumerate(resumed):
        p.set_value(loaded.pop(f"param.{i}").numpy().copy())
    opt2 = make(resumed)
    opt2.load_state_dict(optim.unflatten_state_dict(loaded, meta))
    hyper = lambda o: [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
    assert opt2.step_count.item() == 3 and hyper(opt2) == hyper(opt1)
    run(opt2, resumed, steps=3, start=3)
    for p, q in zip(full, resumed, strict=True):
        np.testing.assert_array_equal(p.numpy(), q.numpy())


def test_load_state_dict_rejects_a_different_optimizer_layout():
    opt = optim.AdamW(make_params([(2,), (3,)]))
    sd = opt.state_dict()
    with pytest.raises(ValueError, match="group 0 saved 2 parameters"):
        optim.AdamW(make_params([(2,)])).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 1 is \[4\], saved \[3\]"):
        optim.AdamW(make_params([(2,), (4,)])).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"group 0 saved unknown hyperparameters \['betas', 'eps'\]"):
        optim.SGD(make_params([(2,), (3,)]), lr=0.1, momentum=0.9).load_state_dict(sd)
    with_momentum = optim.SGD(make_params([(2,)]), lr=0.1, momentum=0.9).state_dict()
    with pytest.raises(ValueError, match=r"parameter 0 has state \[\], saved \['momentum_buffer'\]"):
        optim.SGD(make_params([(2,)]), lr=0.1).load_state_dict(with_momentum)
    with pytest.raises(ValueError, match=r"not a 'state\.<param_index>\.<name>' key"):
        optim.unflatten_state_dict({"weights": lf.zeros(1)}, {"param_groups": [], "step": 0})


@pytest.mark.parametrize("kind", ["adamw", "sgd_nesterov"])
def test_matches_torch_optim_when_installed(kind):
    torch = pytest.importorskip("torch")
    params = make_params(SHAPES)
    tparams = [torch.tensor(p.numpy().copy(), requires_grad=True) for p in params]
    if kind == "adamw":
        opt = optim.AdamW(params, lr=0.05, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.1)
        topt = torch.optim.AdamW(tparams, lr=0.05, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.1)
    else:
        opt = optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
        topt = torch.optim.SGD(tparams, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    run(opt, params)
    for t in range(STEPS):
        for tp, g in zip(tparams, grads_for(t, [tuple(tp.shape) for tp in tparams]), strict=True):
            tp.grad = torch.tensor(g)
        topt.step()
    for p, tp in zip(params, tparams, strict=True):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-10, atol=1e-12)
