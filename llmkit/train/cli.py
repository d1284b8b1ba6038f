"""``llmkit train CONFIG [section.key=value ...] [--resume] [--quiet] [--nproc N [--hostfile F]]``
(overrides and flags in any order), ``llmkit checkpoint merge``, ``llmkit tokenizer``, ``llmkit plot``."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from typing import Any


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: list[str]) -> int:
    p = ArgumentParser(
        prog="llmkit train",
        description="Train a Llama model. Overrides use dotted keys: optim.lr=1e-3 train.steps=50.",
    )
    p.add_argument("config", help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in out_dir; overrides apply from its step on",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="run N processes with mpiexec (parallel.pp x parallel.dp x parallel.tp must be N)",
    )
    p.add_argument("--hostfile", help="with --nproc: mpiexec's hostfile, to run on several machines")
    a = p.parse_intermixed_args(argv)
    from .config import load_config

    cfg = load_config(a.config, a.overrides)
    if cfg.parallel.auto:  # the planner's choice, as overrides (the processes launched get them too)
        from .auto_plan import resolve_auto

        a.overrides = [*a.overrides, *resolve_auto(cfg, a.nproc)]
        cfg = load_config(a.config, a.overrides)
    if a.nproc is not None:
        flags = [f for f, on in (("--resume", a.resume), ("--quiet", a.quiet)) if on]
        return launch(cfg, a.nproc, a.hostfile, [a.config, *a.overrides, *flags])
    if a.hostfile is not None:
        p.error("--hostfile goes with --nproc")
    from llmkit.framework.distributed import CollectiveError

    try:
        return _train(cfg, a.resume, a.quiet)
    except CollectiveError as e:  # a rank died or hangs: name it, and do not wait for it at exit
        print(f"llmkit train: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def _train(cfg, resume: bool, quiet: bool) -> int:
    from .trainer import Interrupted, Trainer

    trainer = Trainer(cfg, resume=resume, quiet=quiet)
    say = print if trainer.is_rank0 else lambda *a, **k: None
    if trainer.backend is not None:
        say(f"parallel: {trainer.plan.describe()} on {trainer.backend} ({trainer.plan.world_size} ranks)")
    if trainer.pipe is not None and not quiet:  # its stages and every rank's job list
        say(trainer.pipe.describe())
    if trainer.resumed_from is not None:
        report_resume(trainer, say)
        read, total, rss = trainer.load_report
        mb = 2**20
        say(
            f"resume: read {read / mb:.3g} MB of {total / mb:.3g} MB per rank; "
            f"peak host memory {rss / mb:.0f} MB"
        )
    try:
        last = trainer.fit()
    except Interrupted as e:
        return report_interrupted(e, "llmkit train", say)
    summary = ", ".join(f"{k}={v:.4g}" for k, v in last.items() if isinstance(v, float))
    say(f"done: step {trainer.step}, {summary}; checkpoints and metrics.jsonl in {cfg.out_dir}")
    return 0


def report_resume(job: Any, say: Any = print) -> None:
    """Where a resumed job continues from, and what its config changed (every job's command line)."""
    say(f"resume: step {job.step} from {job.resumed_from}")
    say(f"resume: {', '.join(job.resume_changes) or 'the config is unchanged'}")


def report_interrupted(e: Any, prog: str, say: Any = print) -> int:
    """The line of a job stopped by SIGINT or SIGTERM (``Interrupted``), and its exit status."""
    say(
        f"{prog}: stopped by {signal.Signals(e.signum).name} at step {e.step}; saved {e.path} "
        "(continue with --resume)",
        file=sys.stderr,
    )
    return 128 + e.signum


def launch(cfg, nproc: int, hostfile: str | None, argv: list[str]) -> int:
    """Replace this process by ``mpiexec -n N python -m llmkit train ARGS`` (one rank per process)."""
    return relaunch(*mpiexec_command(cfg, nproc, hostfile, argv))


def relaunch(cmd: list[str], env: dict[str, str]) -> int:
    """Replace this process by ``cmd`` (an mpiexec command line)."""
    sys.stdout.flush()
    os.execve(cmd[0], cmd, env)
    return 0  # not reached


def mpiexec_command(
    cfg, nproc: int, hostfile: str | None, argv: list[str]
) -> tuple[list[str], dict[str, str]]:
    """The mpiexec command line and environment of ``llmkit train --nproc``; ConfigError when the
    config's mesh has another number of ranks."""
    from .config import check_world

    check_world(cfg.parallel, nproc, "--nproc is {n}")
    return nproc_command(nproc, hostfile, ["train", *argv])


def nproc_command(nproc: int, hostfile: str | None, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """``mpiexec -n N python -m llmkit ARGV`` and its environment (the BLAS threads shared out), for
    any command's ``--nproc N [--hostfile F]``; ConfigError when it cannot work."""
    from llmkit.framework.distributed.comm import launched_by_mpi

    from .config import ConfigError
    from .trainer import cpu_count

    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    if launched_by_mpi():
        raise ConfigError("--nproc: this process already runs under mpiexec; drop --nproc")
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise ConfigError("--nproc needs mpiexec on PATH (pip install 'llmkit[dist]' installs Open MPI)")
    cores = cpu_count()
    cmd = [mpiexec, *(["--oversubscribe"] if nproc > cores else [])]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root unless asked
        cmd.append("--allow-run-as-root")
    if hostfile is not None:
        cmd += ["--hostfile", hostfile]
    cmd += ["-n", str(nproc), sys.executable, "-m", "llmkit", *argv]
    env = dict(os.environ)
    threads = str(max(1, cores // nproc))  # BLAS threads per rank: the cores shared out
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(var, threads)
    return cmd, env


def tokenizer_main(argv: list[str]) -> int:
    """``llmkit tokenizer train --input FILES --vocab-size N --out DIR``."""
    p = ArgumentParser(prog="llmkit tokenizer", description="Tokenizer tools.")
    sub = p.add_subparsers(dest="action", required=True)
    t = sub.add_parser("train", help="train a BPE sentencepiece model with Llama's settings (byte fallback)")
    t.add_argument("--input", nargs="+", required=True, help="text files, globs, .jsonl files or 'builtin'")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True, help="directory to write tokenizer.model into")
    a = p.parse_args(argv)
    from .data import tokenizer_train

    tokenizer_train(a.input, a.vocab_size, a.out)
    print(f"wrote {a.out}/tokenizer.model")
    return 0


def plot_main(argv: list[str]) -> int:
    """``llmkit plot RUN [RUN ...] [--out FILE]``."""
    p = ArgumentParser(
        prog="llmkit plot",
        description="Plot runs to PNG: training loss, RLHF reward and KL, quantization's perplexity "
        "and bytes; several runs (the whole pipeline) one row each.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN", help="a run or quantized model directory")
    p.add_argument(
        "--out", default=None, help="PNG path (default RUN/<first panel>.png; several: pipeline.png by them)"
    )
    a = p.parse_args(argv)
    from .plot import plot_runs

    out = plot_runs(a.run_dirs, a.out)
    print(f"wrote {out}")
    return 0


def checkpoint_main(argv: list[str]) -> int:
    """``llmkit checkpoint merge CHECKPOINT --out DIR``."""
    p = ArgumentParser(prog="llmkit checkpoint", description="Training checkpoint tools.")
    sub = p.add_subparsers(dest="action", required=True)
    m = sub.add_parser(
        "merge", help="write a checkpoint's model (pieces of several ranks too) in the Hugging Face layout"
    )
    m.add_argument("checkpoint", help="a checkpoint directory (out_dir/checkpoints/step-NNNNNNNN)")
    m.add_argument(
        "--out", required=True, help="directory to write config.json, model.safetensors, tokenizer.model"
    )
    a = p.parse_args(argv)
    from pathlib import Path

    from .checkpoint import merge

    out = merge(Path(a.checkpoint), Path(a.out))
    print(f"wrote {out}")
    return 0
