"""``llmkit train CONFIG [section.key=value ...] [--resume] [--quiet] [--nproc N [--hostfile F]]``
(overrides and flags in any order; :func:`job_main`, ``llmkit rlhf``'s command line too),
``llmkit checkpoint merge``, ``llmkit tokenizer``, ``llmkit plot``."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any

from .args import ArgumentParser


def job_main(
    argv: list[str],
    prog: str,
    description: str,
    load: Callable[[str, list[str], int | None], tuple[Any, list[str]]],
    run: Callable[[Any, bool, bool], int],
    check_nproc: Callable[[Any, int], None],
    command: list[str],
    config_help: str = "YAML run config (see configs/)",
    nproc_help: str = "run N processes with mpiexec",
    epilog: str | None = None,
    hard_exit: Callable[[], bool] = lambda: True,
    launch: Callable[[list[str], dict[str, str]], int] | None = None,
) -> int:
    """The command line of a YAML job (``llmkit train``, ``llmkit rlhf``, ``llmkit rlhf reward``):
    ``CONFIG [section.key=value ...] [--resume] [--quiet] [--nproc N [--hostfile F]]``, overrides
    and flags in any order. ``load(config, overrides, nproc)``: the config and the overrides the
    launched processes get; ``--nproc``: ``check_nproc(cfg, N)``, then this process is replaced by
    ``mpiexec -n N python -m llmkit COMMAND ...`` (``launch``: default :func:`relaunch`); else
    ``run(cfg, resume, quiet)``. A rank that died or hangs (CollectiveError) is named in one line,
    and where ``hard_exit()`` (under mpiexec) this process exits without waiting for it."""
    p = ArgumentParser(prog=prog, description=description, epilog=epilog)
    p.add_argument("config", help=config_help)
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in out_dir; overrides apply from its step on",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--nproc", type=int, metavar="N", help=nproc_help)
    p.add_argument("--hostfile", help="with --nproc: mpiexec's hostfile, to run on several machines")
    a = p.parse_intermixed_args(argv)
    cfg, overrides = load(a.config, a.overrides, a.nproc)
    if a.nproc is not None:
        check_nproc(cfg, a.nproc)
        flags = [f for f, on in (("--resume", a.resume), ("--quiet", a.quiet)) if on]
        cmd, env = nproc_command(a.nproc, a.hostfile, [*command, a.config, *overrides, *flags])
        return (launch or relaunch)(cmd, env)
    if a.hostfile is not None:
        p.error("--hostfile goes with --nproc")
    from llmkit.framework.distributed import CollectiveError

    try:
        return run(cfg, a.resume, a.quiet)
    except CollectiveError as e:  # a rank died or hangs: name it, and do not wait for it at exit
        if not hard_exit():
            raise
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def run_job(job: Any, prog: str, stop: Any = None) -> int:
    """Fit a built job (a ``Loop``) and print, from rank 0, where it resumed from, how it stopped,
    or its final metrics; the exit status."""
    from .loop import Interrupted

    say = print if job.is_rank0 else lambda *a, **k: None
    job.report_start(say)
    try:
        last = job.fit(stop)
    except Interrupted as e:  # stopped by SIGINT or SIGTERM
        name = signal.Signals(e.signum).name
        say(
            f"{prog}: stopped by {name} at step {e.step}; saved {e.path} (continue with --resume)",
            file=sys.stderr,
        )
        return 128 + e.signum
    say(f"done: step {job.step}, {job.summary(last)}; {job.written()}")
    return 0


def main(argv: list[str]) -> int:
    return job_main(
        argv,
        "llmkit train",
        "Train a Llama model. Overrides use dotted keys: optim.lr=1e-3 train.steps=50.",
        _load,
        _train,
        _check_nproc,
        ["train"],
        nproc_help="run N processes with mpiexec (parallel.pp x parallel.dp x parallel.tp must be N)",
    )


def _load(path: str, overrides: list[str], nproc: int | None) -> tuple[Any, list[str]]:
    from .config import load_config

    cfg = load_config(path, overrides)
    if cfg.parallel.auto:  # the planner's choice, as overrides (the processes launched get them too)
        from .auto_plan import resolve_auto

        overrides = [*overrides, *resolve_auto(cfg, nproc)]
        cfg = load_config(path, overrides)
    return cfg, overrides


def _check_nproc(cfg: Any, nproc: int) -> None:
    from .config import check_world

    check_world(cfg.parallel, nproc, "--nproc is {n}")


def _train(cfg: Any, resume: bool, quiet: bool) -> int:
    from .trainer import Trainer

    return run_job(Trainer(cfg, resume=resume, quiet=quiet), "llmkit train")


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
    _check_nproc(cfg, nproc)
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
    """``llmkit tokenizer train --input FILES --vocab-size N --out DIR [--kind sentencepiece|bpe]``."""
    from llmkit.models.llama.tokenizer import KINDS

    p = ArgumentParser(prog="llmkit tokenizer", description="Tokenizer tools.")
    sub = p.add_subparsers(dest="action", required=True)
    t = sub.add_parser(
        "train", help="train a tokenizer: Llama 2's sentencepiece BPE or Llama 3's byte-level BPE"
    )
    t.add_argument("--input", nargs="+", required=True, help="text files, globs, .jsonl files or 'builtin'")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True, help="directory to write the tokenizer's Hugging Face files into")
    t.add_argument(
        "--kind",
        choices=list(KINDS),
        default="sentencepiece",
        help="sentencepiece: tokenizer.model (byte fallback); bpe: a byte-level BPE tokenizer.json",
    )
    a = p.parse_args(argv)
    from .data import tokenizer_train

    tok = tokenizer_train(a.input, a.vocab_size, a.out, a.kind)
    print(f"wrote {a.out}: a {tok.vocab_size}-token {a.kind} tokenizer ({', '.join(sorted(tok.files()))})")
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
    """``llmkit checkpoint merge CHECKPOINT --out DIR``; ``llmkit checkpoint merge-lora ADAPTER --out
    DIR [--base DIR]``."""
    p = ArgumentParser(prog="llmkit checkpoint", description="Training checkpoint tools.")
    sub = p.add_subparsers(dest="action", required=True)
    m = sub.add_parser(
        "merge", help="write a checkpoint's model (pieces of several ranks too) in the Hugging Face layout"
    )
    m.add_argument("checkpoint", help="a checkpoint directory (out_dir/checkpoints/step-NNNNNNNN)")
    m.add_argument(
        "--out", required=True, help="directory to write config.json, model.safetensors, tokenizer.model"
    )
    ml = sub.add_parser(
        "merge-lora",
        help="write base + adapters (W + B A alpha/r) as a complete model directory that export, "
        "quantize and serve take",
    )
    ml.add_argument(
        "adapter", help="a LoRA run's checkpoint (out_dir/checkpoints/step-N) or a PEFT adapter directory"
    )
    ml.add_argument("--base", help="the base model directory (default: the checkpoint's base_model.json, "
                    "or the adapter's base_model_name_or_path)")  # fmt: skip
    ml.add_argument("--out", required=True, help="directory to write the merged model and tokenizer to")
    a = p.parse_args(argv)
    from pathlib import Path

    from .checkpoint import merge, merge_lora

    if a.action == "merge-lora":
        out = merge_lora(Path(a.adapter), Path(a.out), None if a.base is None else Path(a.base))
    else:
        out = merge(Path(a.checkpoint), Path(a.out))
    print(f"wrote {out}")
    return 0
