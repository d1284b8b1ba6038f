"""The RLHF run config: one typed schema on the training config's machinery.

    cfg = load_rlhf_config("configs/rlhf-tiny.yaml", ["rollout.n=4", "train.steps=20"])

Sections: ``algorithm`` (grpo | ppo | rloo | dpo), ``model`` (the policy's checkpoint), ``reward``
(one source), ``rollout`` (sampling), ``data`` (prompts or preference pairs), ``rlhf`` (the
algorithm's hyperparameters), ``optim``, ``lr_schedule`` and ``parallel`` (as ``llmkit train``'s; data
parallel only: see data_parallel.py), ``train`` (the loop), ``out_dir``. Errors name the dotted key, as
``llmkit train``'s do; the reward model job (``llmkit rlhf reward``) has its own schema built from
the same sections.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, model_validator

from llmkit.train.config import (
    LoraSection,
    OptimSection,
    ParallelSection,
    RunConfig,
    ScheduleSection,
    Section,
    check_warmup,
    load_config,
)

ALGORITHMS = ("grpo", "ppo", "rloo", "dpo")


class PolicySection(Section):
    """Where the policy starts (and the frozen reference: the same weights, never updated)."""

    # a Hugging Face checkpoint directory, or a run directory of `llmkit train` / `llmkit rlhf`
    # (its newest checkpoint's model/)
    init_from: str = "runs/tiny"


class RewardSection(Section):
    """Exactly one source of rewards."""

    function: str | None = None  # "package.module:function" or "path/file.py:function" (TRL signature)
    model: str | None = None  # a reward model directory (llmkit rlhf reward), or its run directory
    task: str | None = None  # a built-in verifiable task (llmkit.rlhf.tasks.TASKS)
    task_args: dict[str, Any] = Field(default_factory=dict)  # the task's settings, e.g. {letter: e}

    @model_validator(mode="after")
    def _one_source(self) -> RewardSection:
        given = [k for k in ("function", "model", "task") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "set exactly one of reward.function, reward.model and reward.task"
                + (f" (got {', '.join('reward.' + k for k in given)})" if given else "")
            )
        if self.task_args and self.task is None:
            raise ValueError("reward.task_args needs reward.task")
        return self


class RolloutSection(Section):
    """Sampling of the completions; log-probs are always the full vocabulary's at ``temperature``."""

    prompts_per_step: int = Field(8, gt=0)  # prompts per step; each sampled n times
    n: int = Field(8, gt=0)  # completions per prompt (GRPO's and RLOO's group size)
    max_tokens: int = Field(32, gt=0)  # new tokens per completion at most
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)  # 0 = all tokens
    top_p: float = Field(1.0, gt=0, le=1)
    max_batch: int = Field(64, gt=0)  # sequences the engine decodes at once (continuous batching)
    max_prompt_tokens: int = Field(128, gt=1)  # longer prompts keep their BOS and their last tokens


class DataSection(Section):
    prompts: str | None = None  # JSONL {"prompt": text or [messages]}; null: the task's built-in ones
    pairs: str | None = None  # DPO: JSONL {"prompt", "chosen", "rejected"}, or "builtin:<task>"
    val_fraction: float = Field(0.1, ge=0, lt=1)  # DPO: held-out pairs for eval accuracy


class AlgorithmSection(Section):
    """The algorithm's hyperparameters (names as in TRL where it has them)."""

    exact_logprobs: bool = True  # the trainer's forward on the engine's kernels (ratio 1.0 at first)
    kl_coef: float = Field(0.04, ge=0)  # beta of the KL penalty to the reference (0 = no reference)
    kl_estimator: Literal["k1", "k3"] = "k3"
    clip_low: float = Field(0.2, ge=0, lt=1)  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = Field(0.2, ge=0)
    loss_aggregation: Literal["token", "sequence"] = "token"  # mean over all tokens, or per sequence
    scale_rewards: bool = True  # GRPO: divide by the group's std (false: Dr. GRPO)
    epochs: int = Field(1, gt=0)  # passes over a step's rollouts (PPO epochs, GRPO iterations)
    minibatches: int = Field(1, gt=0)  # optimizer steps per pass
    gamma: float = Field(1.0, ge=0, le=1)  # PPO: discount
    lam: float = Field(0.95, ge=0, le=1)  # PPO: GAE lambda
    vf_coef: float = Field(0.1, ge=0)  # PPO: value loss weight
    value_clip: float = Field(0.2, gt=0)  # PPO: value clipping range
    entropy_coef: float = Field(0.0, ge=0)  # PPO: entropy bonus weight
    whiten_advantages: bool = True  # PPO: normalize advantages over the batch
    beta: float = Field(0.1, gt=0)  # DPO: inverse temperature of the implicit reward
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"


class LoopSection(Section):
    steps: int = Field(100, gt=0)  # rollout steps (DPO: optimizer steps)
    batch_size: int = Field(16, gt=0)  # DPO: pairs per step
    log_every: int = Field(1, gt=0)
    eval_every: int = Field(25, ge=0)  # DPO: steps between held-out evaluations; 0 = only at the end
    save_every: int = Field(0, ge=0)  # steps between checkpoints; 0 = only at the end
    keep_last: int = Field(2, gt=0)
    seed: int = Field(0, ge=0)  # prompt order, sampling, data order
    max_length: int = Field(128, gt=0)  # DPO / reward model: prompt + response tokens, longer cut


def refuse_model_parallel(raw: Any) -> Any:
    """RLHF jobs run data parallel only: a ``parallel`` key other than ``dp`` given a value other than
    its default (``parallel: auto`` included) is refused by name, before it could be ignored."""
    par = raw.get("parallel") if isinstance(raw, dict) else None
    if par == "auto":
        par = {"auto": True}
    if not isinstance(par, dict):
        return raw  # the schema reports the wrong type
    for key, field in ParallelSection.model_fields.items():
        if key != "dp" and key in par and (key == "plan" or par[key] != field.default):
            raise ValueError(
                f"parallel.{key}: llmkit rlhf runs data parallel only (parallel.dp); "
                f"parallel.{key} is llmkit train's"
            )
    return raw


def check_data_parallel(par: ParallelSection, rows: int, key: str) -> None:
    """Each of the ``dp`` ranks takes as many of a step's ``rows`` (config key ``key``) as the
    others. ValueError names the key at fault."""
    if rows % par.dp:
        raise ValueError(
            f"{key} ({rows}) must be a multiple of parallel.dp ({par.dp}): each data-parallel rank "
            "takes as many of a step's rows as the others"
        )


_NO_DROPOUT = {  # why each kind of job refuses lora.dropout
    "online": "the trainer's log-probs must equal the rollout engine's (exact_logprobs: the first "
    "ratio 1, logprob_diff_max 0), and a dropout mask makes its forward another function than the engine's",
    "offline": "rlhf checkpoints do not hold the random state that draws the masks, so a resumed run "
    "would draw other masks than the whole run",
}


def check_lora(lora: LoraSection | None, job: str) -> None:
    """Adapters without dropout, for ``_NO_DROPOUT[job]``'s reason (``job``: online or offline)."""
    if lora is not None and lora.dropout:
        raise ValueError(f"lora.dropout ({lora.dropout}): {_NO_DROPOUT[job]}; use lora.dropout: 0")


class RLHFConfig(RunConfig):
    """A whole RLHF run."""

    algorithm: Literal["grpo", "ppo", "rloo", "dpo"] = "grpo"
    model: PolicySection = PolicySection()
    reward: RewardSection | None = None  # not for DPO
    rollout: RolloutSection = RolloutSection()
    data: DataSection = DataSection()
    rlhf: AlgorithmSection = AlgorithmSection()
    optim: OptimSection = OptimSection(lr=1e-5, weight_decay=0.0)
    lr_schedule: ScheduleSection = ScheduleSection(name="constant")
    train: LoopSection = LoopSection()
    parallel: ParallelSection = ParallelSection()  # dp: data-parallel ranks (--nproc N: processes)
    lora: LoraSection | None = None  # adapters on the frozen policy; null: the whole policy trains
    out_dir: str = "runs/rlhf"

    _data_parallel_only = model_validator(mode="before")(refuse_model_parallel)

    @model_validator(mode="after")
    def _consistent(self) -> RLHFConfig:
        if self.algorithm == "dpo":
            if self.data.pairs is None:
                raise ValueError("data.pairs: DPO needs preference pairs (a JSONL file or builtin:<task>)")
        elif self.reward is None:
            raise ValueError(f"reward: {self.algorithm} needs a reward (reward.task, .function or .model)")
        if self.algorithm in ("grpo", "rloo") and self.rollout.n < 2:
            raise ValueError(f"rollout.n: {self.algorithm} compares samples of a prompt; use n >= 2")
        if self.algorithm == "dpo":
            check_data_parallel(self.parallel, self.train.batch_size, "train.batch_size")
        else:  # whole prompts per rank: a prompt's n samples (its group) stay together
            check_data_parallel(self.parallel, self.rollout.prompts_per_step, "rollout.prompts_per_step")
        check_warmup(self.lr_schedule, self.train.steps)
        check_lora(self.lora, "offline" if self.algorithm == "dpo" else "online")
        return self


class RewardModelConfig(RunConfig):
    """``llmkit rlhf reward``: a Bradley-Terry reward model on preference pairs."""

    model: PolicySection = PolicySection()  # the backbone's checkpoint; the scalar head starts fresh
    data: DataSection = DataSection(pairs="builtin:avoid_letter")
    optim: OptimSection = OptimSection(lr=3e-4, weight_decay=0.0)
    lr_schedule: ScheduleSection = ScheduleSection(name="constant")
    train: LoopSection = LoopSection(steps=200)
    parallel: ParallelSection = ParallelSection()
    lora: LoraSection | None = None  # adapters on the frozen backbone (the scalar head trains whole)
    out_dir: str = "runs/reward"

    _data_parallel_only = model_validator(mode="before")(refuse_model_parallel)

    @model_validator(mode="after")
    def _has_pairs(self) -> RewardModelConfig:
        if self.data.pairs is None:
            raise ValueError("data.pairs: a reward model trains on preference pairs")
        check_data_parallel(self.parallel, self.train.batch_size, "train.batch_size")
        check_lora(self.lora, "offline")
        return self


def load_rlhf_config(path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()) -> RLHFConfig:
    return load_config(path, overrides, RLHFConfig)


def load_reward_config(
    path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()
) -> RewardModelConfig:
    return load_config(path, overrides, RewardModelConfig)
