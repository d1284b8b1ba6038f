"""``llmkit train CONFIG [section.key=value ...] [--resume] [--quiet]`` (overrides and flags in any order)."""

from __future__ import annotations

import argparse
import signal
import sys


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
    a = p.parse_intermixed_args(argv)
    from .config import load_config
    from .trainer import Interrupted, Trainer

    cfg = load_config(a.config, a.overrides)
    trainer = Trainer(cfg, resume=a.resume, quiet=a.quiet)
    if trainer.resumed_from is not None:
        print(f"resume: step {trainer.step} from {trainer.resumed_from}")
        print(f"resume: {', '.join(trainer.resume_changes) or 'the config is unchanged'}")
    try:
        last = trainer.fit()
    except Interrupted as e:
        print(
            f"llmkit train: stopped by {signal.Signals(e.signum).name} at step {e.step}; saved {e.path} "
            "(continue with --resume)",
            file=sys.stderr,
        )
        return 128 + e.signum
    summary = ", ".join(f"{k}={v:.4g}" for k, v in last.items() if isinstance(v, float))
    print(f"done: step {trainer.step}, {summary}; checkpoints and metrics.jsonl in {cfg.out_dir}")
    return 0


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
    """``llmkit plot RUN_DIR [--out FILE]``."""
    p = ArgumentParser(prog="llmkit plot", description="Plot a run's training and eval loss to PNG.")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/loss.png)")
    a = p.parse_args(argv)
    from .plot import plot_run

    out = plot_run(a.run_dir, a.out)
    print(f"wrote {out}")
    return 0
