"""One step of each online algorithm, by hand: the advantages the algorithm's rule gives a 2-prompt
batch (3 samples each), then the step's loss on updated log-probs (clipped ratio, the KL term,
PPO's value loss), against float64 loops written here from the papers' definitions.

The rules under test are the ones ``llmkit rlhf`` runs (``trainer.ALGORITHMS`` and ``make_loss``);
only the loops below are the reference. Prompt positions and padding hold garbage in the arrays
that the engine or the reference scorer would fill, so a leak past the mask shows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.rlhf.config import RLHFConfig
from llmkit.rlhf.data import TokenBatch
from llmkit.rlhf.trainer import ALGORITHMS, StepData, make_loss
from llmkit.train.config import parse_config

G = 3  # samples per prompt
PROMPTS = [[1, 7], [1, 9, 4]]  # with BOS
RESPONSES = [[5, 6, 2], [8], [3, 3], [4, 2], [6, 7, 8], [9]]  # prompt-major: rows 0-2, then 3-5
REWARDS = np.array([1.0, 0.0, 0.5, 0.2, 0.9, 0.1])
KL_COEF, CLIP_LOW, CLIP_HIGH = 0.1, 0.2, 0.28
GAMMA, LAM, VF_COEF, VALUE_CLIP = 0.9, 0.8, 0.5, 0.2


def config(algorithm: str) -> RLHFConfig:
    raw = {
        "algorithm": algorithm,
        "reward": {"task": "avoid_letter"},
        "rollout": {"n": G, "prompts_per_step": 2},
        "rlhf": {
            "kl_coef": KL_COEF, "clip_low": CLIP_LOW, "clip_high": CLIP_HIGH, "gamma": GAMMA, "lam": LAM,
            "vf_coef": VF_COEF, "value_clip": VALUE_CLIP,
        },
    }  # fmt: skip
    return parse_config(raw, RLHFConfig)


def step_batch(seed: int = 0):
    """The batch in the training layout, with the engine's log-probs (zero off the responses, as
    ``RolloutBatch.token_array``), the reference's and PPO's values (garbage off the mask)."""
    rng = np.random.default_rng(seed)
    prompts = [p for p in PROMPTS for _ in range(G)]
    tokens = TokenBatch.of(prompts, RESPONSES)
    mask = tokens.mask.astype(np.float64)
    logp = np.where(mask > 0, -rng.uniform(0.2, 3.0, mask.shape), 0.0)
    ref = np.where(mask > 0, logp + rng.normal(0, 0.4, mask.shape), 1e3 * rng.standard_normal(mask.shape))
    values = np.where(mask > 0, rng.normal(0, 0.5, mask.shape), 1e3 * rng.standard_normal(mask.shape))
    return tokens, mask, logp, ref, values


def responses(mask):
    """Each row's response positions, in order (where the policy's log-prob of each token sits)."""
    return [[s for s in range(mask.shape[1]) if mask[b, s]] for b in range(mask.shape[0])]


# ---- advantages, by hand -------------------------------------------------------------------------


def grpo_by_hand(mask, logp, ref, values):
    out = np.zeros_like(mask)
    for b, pos in enumerate(responses(mask)):
        group = list(REWARDS[b // G * G : b // G * G + G])
        mean = sum(group) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (G - 1))
        for s in pos:
            out[b, s] = (REWARDS[b] - mean) / (std + 1e-4)
    return out, None


def rloo_by_hand(mask, logp, ref, values):
    """RLOO with the KL in the reward: r_i - beta * sum_t (log pi - log ref), minus the mean of the
    other samples' (so penalized) rewards."""
    pos = responses(mask)
    shaped = [REWARDS[b] - KL_COEF * sum(logp[b, s] - ref[b, s] for s in pos[b]) for b in range(len(pos))]
    out = np.zeros_like(mask)
    for b in range(len(pos)):
        first = b // G * G
        others = [shaped[j] for j in range(first, first + G) if j != b]
        for s in pos[b]:
            out[b, s] = shaped[b] - sum(others) / (G - 1)
    return out, None


def ppo_by_hand(mask, logp, ref, values):
    """Per-token rewards -beta (log pi - log ref), the sequence's reward on its last token; GAE over
    each response (V = 0 past its end); advantages whitened over every response token."""
    adv, ret = np.zeros_like(mask), np.zeros_like(mask)
    for b, pos in enumerate(responses(mask)):
        running = 0.0
        for n in range(len(pos) - 1, -1, -1):
            s = pos[n]
            r = -KL_COEF * (logp[b, s] - ref[b, s]) + (REWARDS[b] if n == len(pos) - 1 else 0.0)
            next_v = values[b, pos[n + 1]] if n + 1 < len(pos) else 0.0
            running = r + GAMMA * next_v - values[b, s] + GAMMA * LAM * running
            adv[b, s], ret[b, s] = running, running + values[b, s]
    on = [(b, s) for b, pos in enumerate(responses(mask)) for s in pos]
    mean = sum(adv[b, s] for b, s in on) / len(on)
    std = math.sqrt(sum((adv[b, s] - mean) ** 2 for b, s in on) / len(on))
    white = np.zeros_like(mask)
    for b, s in on:
        white[b, s] = (adv[b, s] - mean) / (std + 1e-8)
    return white, ret


BY_HAND = {"grpo": grpo_by_hand, "rloo": rloo_by_hand, "ppo": ppo_by_hand}


# ---- the step's loss, by hand --------------------------------------------------------------------


def loss_by_hand(algorithm, mask, new, old, ref, adv, values=None, old_values=None, returns=None):
    """Mean over the response tokens of -min(rho A, clip(rho, 1 - lo, 1 + hi) A), plus GRPO's
    beta * k3(pi, ref) per token, plus PPO's vf_coef * 0.5 max((V - R)^2, (V_clip - R)^2)."""
    on = [(b, s) for b, pos in enumerate(responses(mask)) for s in pos]
    policy, kl, clipped, vloss = 0.0, 0.0, 0, 0.0
    for b, s in on:
        rho = math.exp(new[b, s] - old[b, s])
        a = adv[b, s]
        bounded = min(max(rho, 1 - CLIP_LOW), 1 + CLIP_HIGH)
        policy += -min(rho * a, bounded * a)
        clipped += bounded * a < rho * a
        d = ref[b, s] - new[b, s]
        kl += math.exp(d) - d - 1
        if values is not None:
            v_clip = old_values[b, s] + min(max(values[b, s] - old_values[b, s], -VALUE_CLIP), VALUE_CLIP)
            vloss += 0.5 * max((values[b, s] - returns[b, s]) ** 2, (v_clip - returns[b, s]) ** 2)
    n = len(on)
    loss = policy / n + (KL_COEF * kl / n if algorithm == "grpo" else 0.0) + VF_COEF * vloss / n
    return loss, clipped / n


def t64(a):
    return lf.tensor(np.asarray(a, dtype=np.float64), dtype="float64")


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "ppo"])
def test_one_step_by_hand(algorithm):
    cfg, algo = config(algorithm), ALGORITHMS[algorithm]
    tokens, mask, logp, ref, values = step_batch()
    data = StepData(tokens, REWARDS, logp, ref, values if algo.value_head else None, G, lambda a: a)
    adv, returns = algo.advantages(data, cfg.rlhf)
    want_adv, want_returns = BY_HAND[algorithm](mask, logp, ref, values)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-12, atol=1e-12)
    if want_returns is not None:
        np.testing.assert_allclose(returns, want_returns, rtol=1e-12, atol=1e-12)
    if not algo.value_head:  # a sequence's advantage orders the group as its reward does
        seq_adv = [adv[b][mask[b] > 0][0] for b in range(G)]
        assert np.argsort(seq_adv).tolist() == np.argsort(REWARDS[:G]).tolist()

    # the loss after an update moved the log-probs: ratios inside and outside the clip range
    rng = np.random.default_rng(2)
    new = logp + np.where(mask > 0, rng.normal(0, 0.5, mask.shape), 0.0)
    logits = rng.normal(size=(*mask.shape, 5))
    new_values = values + rng.normal(0, 0.3, mask.shape) if algo.value_head else None
    args = dict(tokens=float(mask.sum()), sequences=float(len(mask)))
    if algo.kl_in_loss:
        args["ref_logp"] = t64(ref)
    if algo.value_head:
        args.update(old_values=t64(values), returns=t64(returns))
    loss, stats = make_loss(cfg, algo)(
        t64(new),
        t64(logits),
        None if new_values is None else t64(new_values),
        t64(mask),
        t64(logp),
        t64(adv),
        **args,
    )
    want, clip_frac = loss_by_hand(
        algorithm, mask, new, logp, ref, want_adv, new_values, values, want_returns
    )
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert stats["clip_frac"].item() == pytest.approx(clip_frac, rel=1e-12) and 0 < clip_frac < 1
    want_ratio = np.exp(new - logp)[mask > 0].mean()
    assert stats["ratio_mean"].item() == pytest.approx(want_ratio, rel=1e-12)
