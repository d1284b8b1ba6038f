"""``llmkit rlhf CONFIG [section.key=value ...] [--resume] [--quiet] [--nproc N [--hostfile F]]`` and
``llmkit rlhf reward CONFIG ...``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmkit.train.cli import job_main, relaunch, run_job


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


def _check_nproc(cfg: Any, nproc: int) -> None:
    if cfg.parallel.dp != nproc:
        from llmkit.train.config import ConfigError

        raise ConfigError(f"parallel.dp ({cfg.parallel.dp}) ranks, but --nproc is {nproc}; make them equal")


def main(argv: list[str]) -> int:
    job = "reward" if argv[:1] == ["reward"] else "rlhf"
    description, load, build = JOBS[job]
    command = ["rlhf", "reward"] if job == "reward" else ["rlhf"]
    prog = "llmkit " + " ".join(command)

    def run(cfg: Any, resume: bool, quiet: bool) -> int:
        from .data_parallel import run_on_ranks

        return run_on_ranks(lambda stop: run_job(build(cfg, resume, quiet), prog, stop), cfg.parallel.dp)

    from llmkit.framework.distributed.comm import launched_by_mpi

    return job_main(
        argv[1:] if job == "reward" else argv,
        prog,
        description + " Overrides use dotted keys: rollout.n=4 train.steps=50.",
        lambda path, overrides, nproc: (load(path, overrides), overrides),
        run,
        _check_nproc,
        command,
        config_help="YAML config (see configs/rlhf-tiny.yaml, configs/dpo-tiny.yaml)",
        nproc_help="run N processes with mpiexec (parallel.dp must be N)",
        epilog=None if job == "reward" else "llmkit rlhf reward CONFIG ...: train a reward model instead.",
        hard_exit=launched_by_mpi,
        launch=lambda cmd, env: relaunch(cmd, env),  # this module's name, looked up when it runs
    )
