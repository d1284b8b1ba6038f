"""Loss curves of a run as a PNG (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import os
from pathlib import Path

from .metrics import read_metrics


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Training loss per logged step and eval loss, from ``run_dir/metrics.jsonl``; returns the PNG path."""
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} not found: is {run} a training run directory?")
    rows = read_metrics(metrics)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if not train and not evals:
        raise ValueError(f"{metrics} has no loss values to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("llmkit plot needs matplotlib: pip install 'llmkit[plot]'") from e
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", lw=1.5, ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(out) if out else run / "loss.png"
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path
