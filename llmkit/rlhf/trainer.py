"""Online RLHF: ``PolicyTrainer(cfg).fit()`` runs GRPO, RLOO or PPO.

One step::

    prompts (seeded by step) -> rollouts on the engine (live weights)         gen_s
        -> rewards; the reference's log-probs (compiled); PPO: values
        -> advantages (the algorithm's table entry)
        -> epochs x minibatches of the compiled train step                    train_s
        -> the engine told the weights changed (prefix cache dropped)          sync_s

The rollout's log-probs are the behaviour policy's (``old_logp``): with exact log-probs they are
the trainer's own bit for bit (``logprob_diff_max`` = 0, the first ratio 1.0), so no separate
recomputation pass is needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import llmkit.framework as lf
from llmkit.models.llama import LlamaForCausalLM, LlamaTokenizer
from llmkit.train.checkpoint import model_dir

from . import algorithms as A
from . import policy
from .config import RLHFConfig
from .data import TokenBatch, load_prompts, step_rows
from .rewards import build_reward
from .rollout import Rollouts
from .run import Run, build_optimizer

O = lf.ops


@dataclass
class StepData:
    """What the advantage rules see of a step: the batch in the training layout, its rewards, the
    engine's log-probs and the reference's (zeros without a reference), PPO's values."""

    tokens: TokenBatch
    rewards: np.ndarray  # [B]
    logp: np.ndarray  # [B, S] the rollout's, at each response token's position
    ref_logp: np.ndarray  # [B, S]
    values: np.ndarray | None  # [B, S]
    group: int  # samples per prompt


def _per_token(seq: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return seq[:, None] * mask


def _grpo(d: StepData, r: Any) -> tuple[np.ndarray, None]:
    return _per_token(A.grpo_advantages(d.rewards, d.group, r.scale_rewards), d.tokens.mask), None


def _rloo(d: StepData, r: Any) -> tuple[np.ndarray, None]:
    # the KL in the reward, as a sequence total of k1 (TRL's RLOO)
    seq_kl = ((d.logp - d.ref_logp) * d.tokens.mask).sum(axis=1)
    return _per_token(A.rloo_advantages(d.rewards - r.kl_coef * seq_kl, d.group), d.tokens.mask), None


def _ppo(d: StepData, r: Any) -> tuple[np.ndarray, np.ndarray]:
    mask = d.tokens.mask.astype(np.float64)
    token_rewards = -r.kl_coef * (d.logp - d.ref_logp) * mask  # per-token k1 penalty
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)  # each row's last response token
    token_rewards[np.arange(len(last)), last] += d.rewards
    adv, returns = A.gae(token_rewards, d.values, mask, r.gamma, r.lam)
    if r.whiten_advantages:
        adv = A.whiten(adv, mask)
    return adv, returns


@dataclass(frozen=True)
class Algorithm:
    advantages: Callable[[StepData, Any], tuple[np.ndarray, np.ndarray | None]]
    kl_in_loss: bool  # GRPO: the KL estimator in the loss; RLOO, PPO: k1 in the reward
    value_head: bool = False


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(_grpo, kl_in_loss=True),
    "rloo": Algorithm(_rloo, kl_in_loss=False),
    "ppo": Algorithm(_ppo, kl_in_loss=False, value_head=True),
}


def make_loss(cfg: RLHFConfig, algo: Algorithm) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """The train step's loss: clipped policy loss (+ KL for GRPO, + value loss and entropy bonus for
    PPO); stats include the entropy of the policy at the rollout temperature."""
    r, temperature = cfg.rlhf, cfg.rollout.temperature

    def loss_fn(
        logp, logits, values, mask, old_logp, advantages, ref_logp=None, old_values=None, returns=None
    ):
        loss, stats = A.clipped_policy_loss(
            logp,
            old_logp,
            advantages,
            mask,
            r.clip_low,
            r.clip_high,
            ref_logp=ref_logp,
            kl_coef=r.kl_coef,
            kl_estimator=r.kl_estimator,
            aggregation=r.loss_aggregation,
        )
        stats.pop("kl", None)  # reported from the rollout (the same for every algorithm)
        ent = A.masked_mean(O.cast(A.entropy(logits, temperature), "float64"), mask)
        stats["entropy"] = ent
        if values is not None:
            vloss, vstats = A.clipped_value_loss(
                O.cast(values, "float64"), old_values, returns, mask, r.value_clip
            )
            loss = loss + r.vf_coef * vloss
            stats.update(vstats, value_loss=vloss)
        if r.entropy_coef:
            loss = loss - r.entropy_coef * ent
        return loss, stats

    return loss_fn


class PolicyTrainer(Run):
    """GRPO / RLOO / PPO on the engine; see the module docstring."""

    desc = "rlhf"
    shown = ("reward_mean", "kl", "logprob_diff_max", "gen_tokens_per_s")

    def __init__(self, cfg: RLHFConfig, resume: bool = False, quiet: bool = False) -> None:
        super().__init__(cfg, resume, quiet)
        self.algo = ALGORITHMS[cfg.algorithm]
        src = model_dir(cfg.model.init_from)
        self.tokenizer = LlamaTokenizer.from_pretrained(src)
        self.model = LlamaForCausalLM.from_pretrained(src)
        r, ro = cfg.rlhf, cfg.rollout
        self.exact = r.exact_logprobs
        self.reference = LlamaForCausalLM.from_pretrained(src) if r.kl_coef > 0 else None
        self.value_head = policy.ValueHead(self.model.config.hidden_size) if self.algo.value_head else None
        if self.value_head is not None:
            self.extra_layers["value_head"] = self.value_head
        self.reward = build_reward(cfg.reward, self.tokenizer)
        self.prompts = load_prompts(cfg.data.prompts, cfg.train.seed)
        self.rollouts = Rollouts(
            self.model,
            self.tokenizer,
            ro.max_tokens,
            ro.temperature,
            ro.top_k,
            ro.top_p,
            ro.max_batch,
            ro.max_prompt_tokens,
            exact=self.exact,
        )
        layers = [self.model] + ([self.value_head] if self.value_head is not None else [])
        self.optimizer = build_optimizer(cfg.optim, layers)
        self.inputs = ("mask", "old_logp", "advantages")
        if self.algo.kl_in_loss and self.reference is not None:
            self.inputs += ("ref_logp",)
        if self.value_head is not None:
            self.inputs += ("old_values", "returns")
        self.step_fn = policy.train_step(
            self.model,
            self.optimizer,
            make_loss(cfg, self.algo),
            self.inputs,
            self.exact,
            ro.temperature,
            cfg.optim.grad_clip,
            self.value_head,
        )
        self.ref_score = (
            policy.scorer(self.reference, self.exact, ro.temperature) if self.reference is not None else None
        )
        self.pre_score = (
            policy.scorer(self.model, self.exact, ro.temperature, self.value_head)
            if self.value_head
            else None
        )
        self.setup()

    # ---- one step ----------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        cfg, ro = self.cfg, self.cfg.rollout
        rows = step_rows(self.prompts, ro.prompts_per_step, cfg.train.seed, self.step)
        prompts = [row["prompt"] for row in rows]
        batch = self.rollouts.generate(prompts, ro.n, cfg.train.seed, self.step)
        columns = {k: [row[k] for row in rows for _ in range(ro.n)] for k in rows[0] if k != "prompt"}
        rewards = self.reward(
            [p for p in prompts for _ in range(ro.n)], batch.texts, batch.completion_ids, columns
        )

        t0 = time.perf_counter()
        tokens = TokenBatch.of(batch.prompt_ids, batch.completion_ids)
        segments = policy.segment_arrays(*tokens.ids.shape)
        mask = tokens.mask.astype(np.float64)
        roll = batch.token_array(tokens.ids.shape[1])
        ref = self.ref_score(tokens.ids, tokens.targets, *segments)["logp"] if self.ref_score else roll
        values, diff = None, None
        if self.pre_score is not None:
            pre = self.pre_score(tokens.ids, tokens.targets, *segments)
            values, diff = pre["values"].astype(np.float64), _diff(pre["logp"], roll, mask)
        data = StepData(tokens, rewards, roll, ref, values, ro.n)
        advantages, returns = self.algo.advantages(data, cfg.rlhf)
        per_row = {"mask": mask, "old_logp": roll, "advantages": advantages, "ref_logp": ref}
        if values is not None:
            per_row.update(old_values=values, returns=returns)
        stats, first_diff = self._update(tokens, per_row)
        train_s = time.perf_counter() - t0

        sync_s = self.rollouts.sync()
        kl = A.KL_ESTIMATORS[cfg.rlhf.kl_estimator](lf.tensor(roll), lf.tensor(ref)).numpy()
        return {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "kl": float((kl * mask).sum() / max(mask.sum(), 1.0)),
            **stats,
            "logprob_diff_max": first_diff if diff is None else diff,
            "response_len_mean": float(np.mean([len(c) for c in batch.completion_ids])),
            "gen_tokens_per_s": batch.num_tokens / batch.seconds,
            "gen_s": batch.seconds,
            "train_s": train_s,
            "sync_s": sync_s,
        }

    def _update(self, tokens: TokenBatch, per_row: dict[str, np.ndarray]) -> tuple[dict[str, float], float]:
        """``epochs`` passes of ``minibatches`` compiled steps over the step's rows: the means of
        their metrics, and the log-prob difference of the first (pre-update) minibatch."""
        r, n = self.cfg.rlhf, len(tokens.ids)
        totals: dict[str, float] = {}
        first_diff, calls = None, 0
        for epoch in range(r.epochs):
            order = np.random.default_rng([self.cfg.train.seed, self.step, epoch]).permutation(n)
            for part in np.array_split(order, r.minibatches):
                if not len(part):
                    continue
                rows = np.sort(part)
                ids, targets = tokens.ids[rows], tokens.targets[rows]
                width = int(tokens.lengths[rows].max())  # the minibatch's own padding
                ids, targets = ids[:, :width], targets[:, :width]
                arrays = [per_row[k][rows][:, :width] for k in self.inputs]
                out = self.step_fn(ids, targets, *policy.segment_arrays(len(rows), width), *arrays)
                if first_diff is None:
                    first_diff = _diff(
                        out["logp"], per_row["old_logp"][rows][:, :width], per_row["mask"][rows][:, :width]
                    )
                for k, v in out.items():
                    if k != "logp":
                        totals[k] = totals.get(k, 0.0) + float(v)
                calls += 1
        return {k: v / calls for k, v in totals.items()}, first_diff

    def rolled_back(self) -> None:
        self.rollouts.sync()

    def finish(self) -> None:
        if not self.quiet:
            prompts = [row["prompt"] for row in self.prompts[:2]]
            batch = self.rollouts.generate(prompts, 1, self.cfg.train.seed, self.cfg.train.steps)
            for p, c in zip(batch.prompt_ids, batch.texts):
                print(f"sample: {self.tokenizer.decode(p)!r} -> {c!r}")


def _diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    """max |a - b| over the mask (0 for an empty mask)."""
    on = mask > 0
    return float(np.abs(a[on] - b[on]).max()) if on.any() else 0.0
