"""``llmkit rlhf CONFIG [section.key=value ...] [--resume] [--quiet] [--nproc N [--hostfile F]]`` and
``llmkit rlhf reward CONFIG ...``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from llmkit.train.cli import ArgumentParser, nproc_command, relaunch, report_interrupted, report_resume
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
    p.add_argument(
        "--nproc", type=int, metavar="N", help="run N processes with mpiexec (parallel.dp must be N)"
    )
    p.add_argument("--hostfile", help="with --nproc: mpiexec's hostfile, to run on several machines")
    a = p.parse_intermixed_args(argv[1:] if job == "reward" else argv)
    cfg = load(a.config, a.overrides)
    if a.nproc is not None:
        flags = [f for f, on in (("--resume", a.resume), ("--quiet", a.quiet)) if on]
        command = ("rlhf", "reward") if job == "reward" else ("rlhf",)
        if cfg.parallel.dp != a.nproc:
            from llmkit.train.config import ConfigError

            raise ConfigError(
                f"parallel.dp ({cfg.parallel.dp}) ranks, but --nproc is {a.nproc}; make them equal"
            )
        return relaunch(*nproc_command(a.nproc, a.hostfile, [*command, a.config, *a.overrides, *flags]))
    if a.hostfile is not None:
        p.error("--hostfile goes with --nproc")
    from llmkit.framework.distributed import CollectiveError
    from llmkit.framework.distributed.comm import launched_by_mpi

    from .data_parallel import run_on_ranks

    def rank(stop: Any) -> int:
        trainer = build(cfg, a.resume, a.quiet)
        say = print if trainer.dp.is_rank0 else lambda *args, **kw: None
        if trainer.resumed_from is not None:
            report_resume(trainer, say)
        try:
            last = trainer.fit(stop)
        except Interrupted as e:
            return report_interrupted(e, p.prog, say)
        summary = ", ".join(
            f"{k}={v:.4g}" for k, v in last.items() if isinstance(v, float) and not k.endswith("_s")
        )
        say(f"done: step {trainer.step}, {summary}; model in {trainer.final_model_dir()}")
        return 0

    try:
        return run_on_ranks(rank, cfg.parallel.dp)
    except CollectiveError as e:  # under mpiexec: a rank died or hangs; name it, do not wait for it
        if not launched_by_mpi():
            raise
        print(f"{p.prog}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
