"""``llmkit rlhf CONFIG [section.key=value ...] [--resume] [--quiet] [--nproc N [--hostfile F]]`` and
``llmkit rlhf reward CONFIG ...``."""

from __future__ import annotations

from typing import Any

from llmkit.train.cli import job_main, relaunch, run_job

# job -> (description, its config loader in config.py)
JOBS: dict[str, tuple[str, str]] = {
    "rlhf": ("Align a policy with GRPO, PPO, RLOO or DPO (algorithm: in the config).", "load_rlhf_config"),
    "reward": ("Train a Bradley-Terry reward model on preference pairs.", "load_reward_config"),
}


def _build(job: str, cfg: Any, resume: bool, quiet: bool) -> Any:
    """The job's trainer: the reward model's, DPO's or the online algorithms'."""
    if job == "reward":
        from .reward_model import RewardModelTrainer as Trainer
    elif cfg.algorithm == "dpo":
        from .dpo import DPOTrainer as Trainer
    else:
        from .trainer import PolicyTrainer as Trainer
    return Trainer(cfg, resume=resume, quiet=quiet)


def _check_nproc(cfg: Any, nproc: int) -> None:
    if cfg.parallel.dp != nproc:
        from llmkit.train.config import ConfigError

        raise ConfigError(f"parallel.dp ({cfg.parallel.dp}) ranks, but --nproc is {nproc}; make them equal")


def main(argv: list[str]) -> int:
    job = "reward" if argv[:1] == ["reward"] else "rlhf"
    description, loader = JOBS[job]
    command = ["rlhf", "reward"] if job == "reward" else ["rlhf"]
    prog = "llmkit " + " ".join(command)

    def load(path: str, overrides: list[str], nproc: int | None) -> tuple[Any, list[str]]:
        from . import config

        return getattr(config, loader)(path, overrides), overrides

    def run(cfg: Any, resume: bool, quiet: bool) -> int:
        from .data_parallel import run_on_ranks

        return run_on_ranks(
            lambda stop: run_job(_build(job, cfg, resume, quiet), prog, stop), cfg.parallel.dp
        )

    from llmkit.framework.distributed.comm import launched_by_mpi

    return job_main(
        argv[1:] if job == "reward" else argv,
        prog,
        description + " Overrides use dotted keys: rollout.n=4 train.steps=50.",
        load,
        run,
        _check_nproc,
        command,
        config_help="YAML config (see configs/rlhf-tiny.yaml, configs/dpo-tiny.yaml)",
        nproc_help="run N processes with mpiexec (parallel.dp must be N)",
        epilog=None if job == "reward" else "llmkit rlhf reward CONFIG ...: train a reward model instead.",
        hard_exit=launched_by_mpi,
        launch=lambda cmd, env: relaunch(cmd, env),  # this module's name, looked up when it runs
    )
