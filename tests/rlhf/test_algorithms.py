"""Every loss and advantage of llmkit.rlhf.algorithms against a numpy float64 formula written here.

The formulas below are written per token and per sequence with Python loops, from the papers'
definitions, independently of the vectorized code. Masks hide prompt tokens at the start of each
row and padding at its end (positions that hold garbage values, which must not leak into the loss).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.rlhf import algorithms

RNG = np.random.default_rng(0)


def t64(a, grad=False):
    return lf.tensor(np.asarray(a, dtype=np.float64), dtype="float64", requires_grad=grad)


def batch(b=4, s=9, seed=0):
    """Log-probs of a batch whose rows have a prompt (masked), a response, then padding (masked);
    the padding holds huge values so that any leak shows."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 3.0, (b, s))
    old = logp + rng.normal(0, 0.3, (b, s))
    ref = logp + rng.normal(0, 0.5, (b, s))
    mask = np.zeros((b, s))
    for i in range(b):
        start, end = 1 + i % 3, s - (i % 4)
        mask[i, start:end] = 1.0
    for a in (logp, old, ref):
        a[mask == 0] = 1e3 * rng.standard_normal(int((mask == 0).sum()))
    return logp, old, ref, mask


def tokens(mask):
    return [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]


# ---- advantages ------------------------------------------------------------------------------------


def test_grpo_advantages():
    r = RNG.normal(size=12)
    got = algorithms.grpo_advantages(r, 4)
    for g in range(3):
        grp = r[4 * g : 4 * g + 4]
        mean = sum(grp) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / 3)
        for i in range(4):
            assert got[4 * g + i] == pytest.approx((grp[i] - mean) / (std + 1e-4), rel=1e-12)
    centred = algorithms.grpo_advantages(r, 4, scale=False)
    assert centred[:4] == pytest.approx(r[:4] - r[:4].mean(), rel=1e-12)


def test_grpo_advantages_of_equal_rewards_are_zero():
    assert np.all(algorithms.grpo_advantages(np.ones(6), 3) == 0)


def test_rloo_advantages():
    r = RNG.normal(size=10)
    got = algorithms.rloo_advantages(r, 5)
    for g in range(2):
        grp = list(r[5 * g : 5 * g + 5])
        for i in range(5):
            others = grp[:i] + grp[i + 1 :]
            assert got[5 * g + i] == pytest.approx(grp[i] - sum(others) / 4, rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("fn", [algorithms.grpo_advantages, algorithms.rloo_advantages])
def test_advantages_reject_bad_groups(fn):
    with pytest.raises(ValueError, match="groups of 4"):
        fn(np.zeros(6), 4)
    with pytest.raises(ValueError, match="need >= 2"):
        fn(np.zeros(3), 1)


def test_gae():
    b, s = 3, 7
    r = RNG.normal(size=(b, s))
    v = RNG.normal(size=(b, s))
    mask = np.zeros((b, s))
    mask[0, 2:7] = 1
    mask[1, 1:4] = 1
    mask[2, 3:5] = 1
    gamma, lam = 0.9, 0.8
    adv, ret = algorithms.gae(r, v, mask, gamma, lam)
    for i in range(b):
        idx = [j for j in range(s) if mask[i, j]]  # the episode: the masked tokens, in order
        want = {}
        running = 0.0
        for n in range(len(idx) - 1, -1, -1):
            j = idx[n]
            next_v = v[i, idx[n + 1]] if n + 1 < len(idx) else 0.0
            delta = r[i, j] + gamma * next_v - v[i, j]
            running = delta + gamma * lam * running
            want[j] = running
        for j in range(s):
            assert adv[i, j] == pytest.approx(want.get(j, 0.0), rel=1e-12, abs=1e-14)
            assert ret[i, j] == pytest.approx(want[j] + v[i, j] if j in want else 0.0, rel=1e-12, abs=1e-14)


def test_gae_with_gamma_and_lambda_one_is_return_to_go_minus_value():
    r = RNG.normal(size=(2, 5))
    v = RNG.normal(size=(2, 5))
    mask = np.ones((2, 5))
    _, ret = algorithms.gae(r, v, mask, 1.0, 1.0)
    for j in range(5):
        assert ret[:, j] == pytest.approx(r[:, j:].sum(axis=1), rel=1e-12)


def test_whiten():
    x = RNG.normal(3, 2, size=(3, 4))
    mask = (RNG.random((3, 4)) > 0.3).astype(float)
    got = algorithms.whiten(x, mask)
    vals = [x[i, j] for i, j in tokens(mask)]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((a - mean) ** 2 for a in vals) / len(vals))
    for i in range(3):
        for j in range(4):
            assert got[i, j] == pytest.approx((x[i, j] - mean) / (std + 1e-8) * mask[i, j], abs=1e-12)


# ---- the clipped policy loss --------------------------------------------------------------------------


def policy_reference(logp, old, ref, adv, mask, lo, hi, kl_coef, estimator, aggregation):
    """Per token, from the definitions; adv is per sequence [B]."""
    per = np.zeros_like(logp)
    kl = np.zeros_like(logp)
    clipped = np.zeros_like(logp)
    ratios = np.zeros_like(logp)
    for i, j in tokens(mask):
        rho = math.exp(logp[i, j] - old[i, j])
        a = adv[i]
        obj = min(rho * a, min(max(rho, 1 - lo), 1 + hi) * a)
        d = ref[i, j] - logp[i, j]
        kl[i, j] = (math.exp(d) - d - 1) if estimator == "k3" else (logp[i, j] - ref[i, j])
        per[i, j] = -obj + kl_coef * kl[i, j]
        clipped[i, j] = float(min(max(rho, 1 - lo), 1 + hi) * a < rho * a)
        ratios[i, j] = rho
    n = mask.sum()
    if aggregation == "token":
        loss = per.sum() / n
    else:
        loss = np.mean([per[i][mask[i] > 0].sum() / mask[i].sum() for i in range(len(mask))])
    return loss, {"kl": kl.sum() / n, "clip_frac": clipped.sum() / n, "ratio_mean": ratios.sum() / n}


@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_clipped_policy_loss(estimator, aggregation):
    logp, old, ref, mask = batch()
    adv = RNG.normal(size=4)
    args = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05, kl_estimator=estimator, aggregation=aggregation)
    lp = t64(logp, grad=True)
    loss, stats = algorithms.clipped_policy_loss(
        lp, t64(old), t64(adv[:, None]), t64(mask), ref_logp=t64(ref), **args
    )
    want, want_stats = policy_reference(logp, old, ref, adv, mask, 0.2, 0.28, 0.05, estimator, aggregation)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    for k, v in want_stats.items():
        assert stats[k].item() == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert 0 < want_stats["clip_frac"] < 1  # the sample exercises both branches
    # the gradient against central differences of the reference, also zero on masked positions
    loss.backward()
    grad = lp.grad.numpy()
    eps = 1e-6
    for i, j in [(0, 0), (0, 3), (1, 2), (2, 8), (3, 4)]:
        up, down = logp.copy(), logp.copy()
        up[i, j] += eps
        down[i, j] -= eps
        fd = (
            policy_reference(up, old, ref, adv, mask, 0.2, 0.28, 0.05, estimator, aggregation)[0]
            - policy_reference(down, old, ref, adv, mask, 0.2, 0.28, 0.05, estimator, aggregation)[0]
        ) / (2 * eps)
        assert grad[i, j] == pytest.approx(fd, rel=1e-5, abs=1e-9), (i, j)


def test_first_step_ratio_is_one_and_the_loss_is_minus_the_mean_advantage():
    logp, _, _, mask = batch()
    adv = RNG.normal(size=(4, 9))
    loss, stats = algorithms.clipped_policy_loss(t64(logp), t64(logp), t64(adv), t64(mask))
    assert stats["ratio_mean"].item() == 1.0 and stats["clip_frac"].item() == 0.0
    assert loss.item() == pytest.approx(-(adv * mask).sum() / mask.sum(), rel=1e-12)


# ---- PPO's value loss and entropy ------------------------------------------------------------------------


def test_clipped_value_loss():
    _, _, _, mask = batch()
    v, old, ret = (RNG.normal(size=(4, 9)) for _ in range(3))
    loss, stats = algorithms.clipped_value_loss(t64(v), t64(old), t64(ret), t64(mask), clip=0.3)
    total, n, clipped = 0.0, 0, 0
    for i, j in tokens(mask):
        vc = old[i, j] + min(max(v[i, j] - old[i, j], -0.3), 0.3)
        a, b = (v[i, j] - ret[i, j]) ** 2, (vc - ret[i, j]) ** 2
        total += 0.5 * max(a, b)
        clipped += b > a
        n += 1
    assert loss.item() == pytest.approx(total / n, rel=1e-12)
    assert stats["value_clip_frac"].item() == pytest.approx(clipped / n, rel=1e-12)


def test_entropy():
    logits = RNG.normal(size=(2, 3, 7)) * 3
    got = algorithms.entropy(t64(logits), temperature=0.7).numpy()
    for i in range(2):
        for j in range(3):
            z = logits[i, j] / 0.7
            p = [math.exp(x) for x in z]
            p = [x / sum(p) for x in p]
            assert got[i, j] == pytest.approx(-sum(x * math.log(x) for x in p), rel=1e-12)


def test_masked_and_sequence_means():
    x = RNG.normal(size=(3, 5))
    mask = np.array([[0, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=float)  # an empty row
    assert algorithms.masked_mean(t64(x), t64(mask)).item() == pytest.approx(
        (x[0, 1] + x[0, 2] + x[1, :4].sum()) / 6, rel=1e-12
    )
    assert algorithms.sequence_mean(t64(x), t64(mask)).item() == pytest.approx(
        ((x[0, 1] + x[0, 2]) / 2 + x[1, :4].sum() / 4 + 0.0) / 3, rel=1e-12
    )


# ---- DPO, IPO and Bradley-Terry ----------------------------------------------------------------------


def sequence_logps(seed):
    rng = np.random.default_rng(seed)
    return [-rng.uniform(5, 30, 6) for _ in range(4)]  # chosen, rejected, ref chosen, ref rejected


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_dpo_loss(kind):
    pc, pr, rc, rr = sequence_logps(1)
    beta = 0.3
    tensors = [t64(a, grad=True) for a in (pc, pr, rc, rr)]
    loss, stats = algorithms.dpo_loss(*tensors, beta=beta, kind=kind)

    def reference(pc, pr):
        out = []
        for i in range(6):
            h = (pc[i] - rc[i]) - (pr[i] - rr[i])
            out.append(math.log(1 + math.exp(-beta * h)) if kind == "sigmoid" else (h - 1 / (2 * beta)) ** 2)
        return sum(out) / 6

    assert loss.item() == pytest.approx(reference(pc, pr), rel=1e-12)
    cw, cl = beta * (pc - rc), beta * (pr - rr)
    assert stats["accuracy"].item() == pytest.approx(np.mean([a > b for a, b in zip(cw, cl)]))
    assert stats["margin"].item() == pytest.approx(np.mean(cw - cl), rel=1e-12)
    loss.backward()
    eps = 1e-6
    for i in range(6):
        up, down = pc.copy(), pc.copy()
        up[i] += eps
        down[i] -= eps
        fd = (reference(up, pr) - reference(down, pr)) / (2 * eps)
        assert tensors[0].grad.numpy()[i] == pytest.approx(fd, rel=1e-6, abs=1e-10)


def test_log_sigmoid_does_not_overflow():
    x = t64([-800.0, -30.0, 0.0, 30.0, 800.0])
    got = algorithms.log_sigmoid(x).numpy()
    want = [-800.0, -30.0 - math.log1p(math.exp(-30)), -math.log(2), -math.log1p(math.exp(-30)), 0.0]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_bradley_terry_loss():
    c, r = RNG.normal(size=8), RNG.normal(size=8)
    loss, stats = algorithms.bradley_terry_loss(t64(c), t64(r))
    want = sum(-math.log(1 / (1 + math.exp(-(a - b)))) for a, b in zip(c, r)) / 8
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert stats["accuracy"].item() == pytest.approx(np.mean(c > r))
