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

Data parallel (data_parallel.py): rank r takes its share of the step's prompts with all their samples
(rows ``first .. first + B/dp - 1`` of the step's B), so the advantages of GRPO's and RLOO's groups
are computed where the group is; PPO whitens with the whole batch's statistics. The minibatches are
the one-process run's (the same permutation of the B rows): each rank runs its rows of each one
(a masked-out row when it has none) with the whole minibatch's counts, and the compiled step sums
the gradients over the ranks. Metrics are the whole batch's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import llmkit.framework as lf
from llmkit.models.llama import LlamaForCausalLM
from llmkit.train.loop import build_optimizer

from . import algorithms, policy
from .config import RLHFConfig
from .data import TokenBatch, load_prompts, step_rows
from .rewards import build_reward
from .rollout import Rollouts
from .run import Run

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
    total: Callable[[np.ndarray], np.ndarray]  # an array summed over the data-parallel ranks


def _per_token(seq: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return seq[:, None] * mask


def _grpo(d: StepData, r: Any) -> tuple[np.ndarray, None]:
    return _per_token(algorithms.grpo_advantages(d.rewards, d.group, r.scale_rewards), d.tokens.mask), None


def _rloo(d: StepData, r: Any) -> tuple[np.ndarray, None]:
    # the KL in the reward, as a sequence total of k1 (TRL's RLOO)
    seq_kl = ((d.logp - d.ref_logp) * d.tokens.mask).sum(axis=1)
    advantages = algorithms.rloo_advantages(d.rewards - r.kl_coef * seq_kl, d.group)
    return _per_token(advantages, d.tokens.mask), None


def _ppo(d: StepData, r: Any) -> tuple[np.ndarray, np.ndarray]:
    mask = d.tokens.mask.astype(np.float64)
    token_rewards = -r.kl_coef * (d.logp - d.ref_logp) * mask  # per-token k1 penalty
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)  # each row's last response token
    token_rewards[np.arange(len(last)), last] += d.rewards
    adv, returns = algorithms.gae(token_rewards, d.values, mask, r.gamma, r.lam)
    if r.whiten_advantages:
        adv = algorithms.whiten(adv, mask, total=d.total)
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

    # optional: ref_logp (GRPO's KL term), old_values and returns (PPO's value loss)
    def loss_fn(logp, logits, values, mask, old_logp, advantages, tokens, sequences, **optional):
        counts = {"token": tokens, "sequence": sequences}
        loss, stats = algorithms.clipped_policy_loss(
            logp,
            old_logp,
            advantages,
            mask,
            r.clip_low,
            r.clip_high,
            ref_logp=optional.get("ref_logp"),
            kl_coef=r.kl_coef,
            kl_estimator=r.kl_estimator,
            aggregation=r.loss_aggregation,
            counts=counts,
        )
        stats.pop("kl", None)  # reported from the rollout (the same for every algorithm)
        ent = algorithms.masked_mean(O.cast(algorithms.entropy(logits, temperature), "float64"), mask, counts)
        stats["entropy"] = ent
        if values is not None:
            args = (optional["old_values"], optional["returns"], mask, r.value_clip, counts)
            vloss, vstats = algorithms.clipped_value_loss(O.cast(values, "float64"), *args)
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
    one_update_per_step = False  # epochs x minibatches optimizer steps a step

    def __init__(self, cfg: RLHFConfig, resume: bool = False, quiet: bool = False) -> None:
        super().__init__(cfg, resume, quiet)
        self.algo = ALGORITHMS[cfg.algorithm]
        self.model = LlamaForCausalLM.from_pretrained(self.src)
        self.add_adapters(self.model)
        r, ro = cfg.rlhf, cfg.rollout
        self.exact = r.exact_logprobs
        self.value_head = policy.ValueHead(self.model.config.hidden_size) if self.algo.value_head else None
        if self.value_head is not None:
            self.extra_layers["value_head"] = self.value_head
        self.reward = build_reward(cfg.reward, self.tokenizer)
        self.prompts = load_prompts(cfg.data.prompts, cfg.train.seed)
        sampling = ro.model_dump(exclude={"prompts_per_step", "n"})  # Rollouts' settings, by name
        self.rollouts = Rollouts(self.model, self.tokenizer, **sampling, exact=self.exact)
        self.optimizer = build_optimizer(cfg.optim, self.model, *self.extra_layers.values())
        self.inputs = ("mask", "old_logp", "advantages")  # per row; then the minibatch's counts
        if self.algo.kl_in_loss and r.kl_coef > 0:
            self.inputs += ("ref_logp",)
        if self.value_head is not None:
            self.inputs += ("old_values", "returns")
        self.step_fn = policy.train_step(
            self.model,
            self.optimizer,
            make_loss(cfg, self.algo),
            (*self.inputs, "tokens", "sequences"),
            self.exact,
            ro.temperature,
            cfg.optim.grad_clip,
            self.value_head,
            self.dp.group if self.dp.size > 1 else None,
        )
        self.ref_score = None  # no reference without a KL term
        if r.kl_coef > 0:
            self.ref_score = policy.reference_scorer(self.model, self.src, self.exact, ro.temperature)
        self.pre_score = None  # PPO: the values (and log-probs) before the update
        if self.value_head is not None:
            self.pre_score = policy.scorer(self.model, self.exact, ro.temperature, self.value_head)
        self.setup()

    # ---- one step ----------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        cfg, ro, dp = self.cfg, self.cfg.rollout, self.dp
        rows = step_rows(self.prompts, ro.prompts_per_step, cfg.train.seed, self.step)
        rows = rows[dp.rows(len(rows))]  # this rank's prompts, each with its n samples
        first = dp.rows(ro.prompts_per_step).start * ro.n  # its first row of the step's batch
        prompts = [row["prompt"] for row in rows]
        batch = self.rollouts.generate(prompts, ro.n, cfg.train.seed, self.step, first)
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
        data = StepData(tokens, rewards, roll, ref, values, ro.n, dp.sum)
        advantages, returns = self.algo.advantages(data, cfg.rlhf)
        per_row = {"mask": mask, "old_logp": roll, "advantages": advantages, "ref_logp": ref}
        if values is not None:
            per_row.update(old_values=values, returns=returns)
        # every row's response length (its masked tokens): the minibatches' counts, and a metric
        lengths = dp.gather(np.array([len(c) for c in batch.completion_ids], np.int64), what="lengths")
        stats, first_diff = self._update(tokens, per_row, first, lengths)
        train_s = time.perf_counter() - t0

        sync_s = self.rollouts.sync()
        kl = algorithms.KL_ESTIMATORS[cfg.rlhf.kl_estimator](lf.tensor(roll), lf.tensor(ref)).numpy()
        all_rewards = dp.gather(rewards, what="rewards")
        kl_sum, tokens_sum, gen_tokens = dp.sum([(kl * mask).sum(), mask.sum(), batch.num_tokens], "kl")
        worst = dp.max([first_diff if diff is None else diff, batch.seconds, train_s, sync_s], "timings")
        return {
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std()),
            "kl": float(kl_sum / max(tokens_sum, 1.0)),
            **stats,
            "logprob_diff_max": float(worst[0]),
            "response_len_mean": float(lengths.mean()),
            "gen_tokens_per_s": float(gen_tokens / worst[1]),
            **{k: float(v) for k, v in zip(("gen_s", "train_s", "sync_s"), worst[1:], strict=True)},
        }

    def _update(
        self, tokens: TokenBatch, per_row: dict[str, np.ndarray], first: int, lengths: np.ndarray
    ) -> tuple[dict[str, float], float]:
        """``epochs`` passes of ``minibatches`` compiled steps over the step's rows: the means of
        their metrics, and the log-prob difference of the first (pre-update) minibatch on this rank.

        The minibatches are cut from the whole batch (``lengths``: every row's masked tokens);
        this rank runs the rows of each that it holds (rows ``first ..`` of the batch)."""
        r, n = self.cfg.rlhf, len(tokens.ids)
        totals: dict[str, float] = {}
        first_diff, calls = None, 0
        for epoch in range(r.epochs):
            order = np.random.default_rng([self.cfg.train.seed, self.step, epoch]).permutation(len(lengths))
            for part in np.array_split(order, r.minibatches):
                if not len(part):
                    continue
                counts = [float(max(lengths[part].sum(), 1)), float(len(part))]  # tokens, sequences
                rows = np.sort(part[(part >= first) & (part < first + n)]) - first
                out = self.step_fn(*self._minibatch(tokens, per_row, rows), *counts)
                if first_diff is None:  # before the first update (no rows here: nothing to compare)
                    width = out["logp"].shape[1]
                    old, mask = (per_row[k][rows][:, :width] for k in ("old_logp", "mask"))
                    first_diff = _diff(out["logp"], old, mask) if len(rows) else 0.0
                for k, v in out.items():
                    if k != "logp":
                        totals[k] = totals.get(k, 0.0) + float(v)
                calls += 1
        return {k: v / calls for k, v in self.dp_stats(totals).items()}, first_diff

    def _minibatch(self, tokens: TokenBatch, per_row: dict[str, np.ndarray], rows: np.ndarray) -> list:
        """The step's inputs for ``rows`` of this rank's batch, at the rows' own padding; no rows
        (another rank holds the whole minibatch): one masked-out row, which adds exactly zero to the
        loss, the statistics and the gradients."""
        if not len(rows):
            zeros = np.zeros((1, 1), np.int64)
            return [zeros, zeros, *policy.segment_arrays(1, 1), *(np.zeros((1, 1)) for _ in self.inputs)]
        width = int(tokens.lengths[rows].max())  # the minibatch's own padding
        ids, targets = tokens.ids[rows][:, :width], tokens.targets[rows][:, :width]
        arrays = [per_row[k][rows][:, :width] for k in self.inputs]
        return [ids, targets, *policy.segment_arrays(len(rows), width), *arrays]

    def rolled_back(self) -> None:
        self.rollouts.sync()

    def finish(self) -> None:
        if not self.quiet and self.dp.is_rank0:
            prompts = [row["prompt"] for row in self.prompts[:2]]
            batch = self.rollouts.generate(prompts, 1, self.cfg.train.seed, self.cfg.train.steps)
            for p, c in zip(batch.prompt_ids, batch.texts):
                print(f"sample: {self.tokenizer.decode(p)!r} -> {c!r}")


def _diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    """max |a - b| over the mask (0 for an empty mask)."""
    on = mask > 0
    return float(np.abs(a[on] - b[on]).max()) if on.any() else 0.0
