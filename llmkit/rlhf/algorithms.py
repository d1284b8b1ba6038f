"""RLHF's losses and advantages, as pure functions.

Advantages are computed once per step from rewards and values, without gradients: numpy float64
in, numpy float64 out. Losses are written with the framework's ops, so the same function runs
eagerly (tests, DPO) and inside a traced training step; each returns ``(loss, stats)`` with
``stats`` a dict of scalar tensors (the metrics of ``metrics.jsonl``).

Shapes: ``B`` sequences of ``S`` positions. A per-token tensor holds at position ``s`` the value for
the token at ``s`` (whatever alignment the caller chose); ``mask`` [B, S] is 1.0 on the tokens the
loss sees (response tokens) and 0.0 on prompt tokens and padding, in the dtype of the log-probs.
Every loss is the same mathematics whether or not masked positions hold garbage.

Data parallel: a loss's means are sums divided by counts, and ``counts`` (``{"token": masked tokens,
"sequence": sequences}``, or ``count`` pairs) may be the whole batch's when the call sees one rank's
share of it: the ranks' losses, statistics and gradients then add up to the whole batch's.

==================  ==========================================================================
GRPO                group-normalized advantages, clipped ratio, KL to the reference in the loss
RLOO                leave-one-out baseline, clipped ratio (KL in the reward)
PPO                 GAE over a value head, clipped policy and value losses, entropy bonus
DPO                 beta-scaled log-ratio margins: sigmoid (Rafailov et al.) and IPO (Azar et al.)
reward model        Bradley-Terry: -log sigmoid(r_chosen - r_rejected)
==================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

import llmkit.framework as lf

O = lf.ops
Tensor = lf.Tensor


# ---- advantages (numpy float64) ------------------------------------------------------------------


def _groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if group_size < 2 or r.ndim != 1 or r.size % group_size:
        raise ValueError(
            f"advantages: {r.size} rewards do not form groups of {group_size} samples (need >= 2 each)"
        )
    return r.reshape(-1, group_size)  # (prompts, G): a prompt's samples are consecutive


def grpo_advantages(
    rewards: np.ndarray, group_size: int, scale: bool = True, eps: float = 1e-4
) -> np.ndarray:
    """GRPO (Shao et al. 2024): ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` with the
    sample standard deviation (ddof=1); ``scale=False`` keeps only the centering (Dr. GRPO)."""
    g = _groups(rewards, group_size)
    a = g - g.mean(axis=1, keepdims=True)
    if scale:
        a = a / (g.std(axis=1, ddof=1, keepdims=True) + eps)
    return a.reshape(-1)


def rloo_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """RLOO (Ahmadian et al. 2024): ``A_i = r_i - mean_{j != i} r_j``, the other samples' mean as
    the baseline of each."""
    g = _groups(rewards, group_size)
    baseline = (g.sum(axis=1, keepdims=True) - g) / (group_size - 1)
    return (g - baseline).reshape(-1)


def gae(
    rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float = 1.0, lam: float = 0.95
) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation (Schulman et al. 2016) over the masked tokens of each row.

    ``delta_t = r_t + gamma V_{t'} - V_t`` and ``A_t = delta_t + gamma lam A_{t'}``, where ``t'`` is
    the next masked position of the row (the value past the last one is 0: the episode ends).
    Returns ``(advantages, returns = advantages + values)``, zero off the mask. [B, S] float64.
    """
    r, v, m = (np.asarray(a, dtype=np.float64) for a in (rewards, values, mask))
    adv = np.zeros_like(r)
    next_v, next_a = np.zeros(r.shape[0]), np.zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        on = m[:, t] > 0
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = np.where(on, a, 0.0)
        next_v = np.where(on, v[:, t], next_v)  # masked positions are skipped, not episode ends
        next_a = np.where(on, a, next_a)
    return adv, (adv + v) * m


def whiten(
    x: np.ndarray,
    mask: np.ndarray,
    eps: float = 1e-8,
    total: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """``(x - mean) / (std + eps)`` over the masked entries (population std); zero off the mask.
    ``total`` sums an array over the data-parallel ranks when ``x`` is one rank's share of the batch
    (the statistics are then the whole batch's)."""
    total = total or (lambda a: a)
    x, m = np.asarray(x, dtype=np.float64), np.asarray(mask, dtype=np.float64)
    s, n = total(np.array([(x * m).sum(), m.sum()]))
    n = max(n, 1.0)
    mean = s / n
    std = np.sqrt(total(np.array([(((x - mean) * m) ** 2).sum()]))[0] / n)
    return (x - mean) / (std + eps) * m


# ---- reductions over masked tokens -----------------------------------------------------------------


Counts = Mapping[str, Tensor]  # {"token": masked tokens, "sequence": sequences} of the whole batch


def masked_mean(x: Tensor, mask: Tensor, counts: Counts | None = None) -> Tensor:
    """Mean of ``x`` over the masked tokens of the whole batch (0 when there are none):
    ``sum(x * mask) / counts["token"]``, by default ``max(sum(mask), 1)``."""
    n = O.maximum(mask.sum(), 1.0) if counts is None else counts["token"]
    return (x * mask).sum() / n


def sequence_mean(x: Tensor, mask: Tensor, counts: Counts | None = None) -> Tensor:
    """Each sequence's mean over its masked tokens, then the mean over the sequences (GRPO's
    original normalization: every sequence weighs the same whatever its length); the sequences'
    sum over ``counts["sequence"]``, by default B."""
    per_seq = (x * mask).sum(axis=-1) / O.maximum(mask.sum(axis=-1), 1.0)  # (B,)
    return per_seq.mean() if counts is None else per_seq.sum() / counts["sequence"]


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, Counts | None], Tensor]] = {
    "token": masked_mean,
    "sequence": sequence_mean,
}


# ---- KL to the reference ----------------------------------------------------------------------------


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``log pi - log pi_ref`` per token: unbiased for KL(pi || ref), can be negative (Schulman 2020)."""
    return logp - ref_logp


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``exp(d) - d - 1`` with ``d = log pi_ref - log pi``: unbiased, never negative (Schulman 2020)."""
    d = ref_logp - logp
    return O.exp(d) - d - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k3": kl_k3}


# ---- policy gradient losses -------------------------------------------------------------------------


def clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "token",
    counts: Counts | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate (GRPO, RLOO and PPO share it), with an optional KL term (GRPO).

    With ``rho = exp(logp - old_logp)`` per token and advantages ``A`` (per token, or [B, 1] per
    sequence, broadcast)::

        loss_t = -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) + kl_coef * KL_t(pi, ref)

    aggregated over the mask by ``aggregation`` ("token" or "sequence"; ``counts``: see above).
    Stats: ``kl`` (masked mean of the estimator; 0 without a reference), ``clip_frac`` (tokens whose
    clipped term was the minimum and differed), ``ratio_mean``.
    """
    agg = AGGREGATIONS[aggregation]
    on = mask > 0.0  # off the mask the log-probs may be anything: keep exp() there at exp(0)
    ratio = O.exp(O.where(on, logp - old_logp, 0.0))
    clipped = O.minimum(O.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    unclipped_obj, clipped_obj = ratio * advantages, clipped * advantages
    per_token = -O.minimum(unclipped_obj, clipped_obj)
    stats = {
        "clip_frac": masked_mean(O.cast(clipped_obj < unclipped_obj, dtype=logp.dtype), mask, counts),
        "ratio_mean": masked_mean(ratio, mask, counts),
    }
    if ref_logp is not None:
        kl = KL_ESTIMATORS[kl_estimator](logp, O.where(on, ref_logp, logp))
        stats["kl"] = masked_mean(kl, mask, counts)
        if kl_coef:
            per_token = per_token + kl_coef * kl
    return agg(per_token, mask, counts), stats


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float = 0.2,
    counts: Counts | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's value loss: ``0.5 max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = old + clip(V - old,
    -clip, clip)``, masked mean over tokens. Stats: ``value_clip_frac``."""
    v_clip = old_values + O.minimum(O.maximum(values - old_values, -clip), clip)
    a, b = (values - returns) ** 2, (v_clip - returns) ** 2
    loss = 0.5 * masked_mean(O.maximum(a, b), mask, counts)
    return loss, {"value_clip_frac": masked_mean(O.cast(b > a, dtype=values.dtype), mask, counts)}


def entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / T) per position over the full vocabulary: [..., V] -> [...]."""
    z = logits / temperature if temperature != 1.0 else logits
    logp = O.log_softmax(z, axis=-1)
    return -(O.exp(logp) * logp).sum(axis=-1)


# ---- preference losses -------------------------------------------------------------------------------


def log_sigmoid(x: Tensor) -> Tensor:
    """``log sigmoid(x) = min(x, 0) - log(1 + exp(-|x|))`` (no overflow for large |x|)."""
    return O.minimum(x, 0.0) - O.log(1.0 + O.exp(-O.abs(x)))


def _dpo_sigmoid(h: Tensor, beta: float) -> Tensor:
    return -log_sigmoid(beta * h)


def _ipo(h: Tensor, beta: float) -> Tensor:
    return (h - 1.0 / (2.0 * beta)) ** 2


# per-pair loss of h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))
DPO_LOSSES: dict[str, Callable[[Tensor, float], Tensor]] = {"sigmoid": _dpo_sigmoid, "ipo": _ipo}


def dpo_loss(
    chosen_logp: Tensor,
    rejected_logp: Tensor,
    ref_chosen_logp: Tensor,
    ref_rejected_logp: Tensor,
    beta: float = 0.1,
    kind: str = "sigmoid",
    count: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO over sequence log-probabilities [B] (sums over each response's tokens).

    With ``h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))``:
    "sigmoid" (Rafailov et al. 2023) ``-log sigmoid(beta h)``; "ipo" (Azar et al. 2023)
    ``(h - 1 / (2 beta))^2``; mean over pairs (sums over ``count``, by default B). Stats: the
    implicit rewards ``beta (log pi - log ref)`` of chosen and rejected, ``accuracy`` (chosen's above
    rejected's) and ``margin`` (their mean gap).
    """
    chosen = beta * (chosen_logp - ref_chosen_logp)
    rejected = beta * (rejected_logp - ref_rejected_logp)
    h = (chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp)
    mean = _pair_mean(count)
    loss = mean(DPO_LOSSES[kind](h, beta))
    stats = {
        "accuracy": mean(O.cast(chosen > rejected, dtype=chosen.dtype)),
        "margin": mean(chosen - rejected),
        "reward_chosen": mean(chosen),
        "reward_rejected": mean(rejected),
    }
    return loss, stats


def _pair_mean(count: float | None) -> Callable[[Tensor], Tensor]:
    return (lambda x: x.mean()) if count is None else (lambda x: x.sum() / count)


def bradley_terry_loss(
    chosen: Tensor, rejected: Tensor, count: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Reward-model loss ``-log sigmoid(r_w - r_l)`` averaged over pairs [B] (sums over ``count``,
    by default B); stats ``accuracy`` (r_w > r_l) and ``margin`` (mean r_w - r_l)."""
    d = chosen - rejected
    mean = _pair_mean(count)
    stats = {"accuracy": mean(O.cast(d > 0.0, dtype=d.dtype)), "margin": mean(d)}
    return mean(-log_sigmoid(d)), stats
