"""``llmkit rlhf CONFIG [section.key=value ...] [--resume]`` and ``llmkit rlhf reward CONFIG ...``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmkit.train.cli import ArgumentParser, report_interrupted, report_resume
from llmkit.train.trainer import Interrupted


def _policy_job(cfg: Any, resume: bool, quiet: bool) -> Any:
    if cfg.algorithm == "dpo":
        from .dpo import DPOTrainer as Trainer
    else:
        from .trainer import PolicyTrainer as Trainer
    return Trainer(cfg, resume=resume, quiet=quiet)


def _reward_job(cfg: Any, resume: bool, quiet: bool) -> Any:
    from .reward_model import RewardModelTrainer

    return RewardModelTrainer(cfg, resume=resume, quiet=quiet)


def _load_rlhf(path: str, overrides: list[str]) -> Any:
    from .config import load_rlhf_config

    return load_rlhf_config(path, overrides)


def _load_reward(path: str, overrides: list[str]) -> Any:
    from .config import load_reward_config

    return load_reward_config(path, overrides)


# job -> (description, config loader, trainer factory)
JOBS: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {
    "rlhf": (
        "Align a policy with GRPO, PPO, RLOO or DPO (algorithm: in the config).",
        _load_rlhf,
        _policy_job,
    ),
    "reward": ("Train a Bradley-Terry reward model on preference pairs.", _load_reward, _reward_job),
}


def main(argv: list[str]) -> int:
    job = "reward" if argv[:1] == ["reward"] else "rlhf"
    description, load, build = JOBS[job]
    p = ArgumentParser(
        prog="llmkit rlhf" + (" reward" if job == "reward" else ""),
        description=description + " Overrides use dotted keys: rollout.n=4 train.steps=50.",
        epilog=None if job == "reward" else "llmkit rlhf reward CONFIG ...: train a reward model instead.",
    )
    p.add_argument("config", help="YAML config (see configs/rlhf-tiny.yaml, configs/dpo-tiny.yaml)")
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in out_dir")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_intermixed_args(argv[1:] if job == "reward" else argv)
    trainer = build(load(a.config, a.overrides), a.resume, a.quiet)
    if trainer.resumed_from is not None:
        report_resume(trainer)
    try:
        last = trainer.fit()
    except Interrupted as e:
        return report_interrupted(e, p.prog)
    summary = ", ".join(
        f"{k}={v:.4g}" for k, v in last.items() if isinstance(v, float) and not k.endswith("_s")
    )
    print(f"done: step {trainer.step}, {summary}; model in {trainer.final_model_dir()}")
    return 0
