"""A run's curves as a PNG (matplotlib, the ``plot`` extra), for any job that writes ``metrics.jsonl``.

Each panel is a row of the table below, drawn when the run logged any of its metrics: a training
run gets its loss (``loss.png``), an RLHF run its reward and KL (``reward.png``), DPO and reward
model runs their losses and preference accuracy.
"""

from __future__ import annotations

import os
from pathlib import Path

from .metrics import read_metrics

# (panel title, y label, [(metric, label, style)]); the first panel with data names the file
PANELS: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("reward", "reward", [("reward_mean", "mean reward", "-")]),
    ("loss", "loss (nats/token)", [("loss", "train loss", "-"), ("eval_loss", "eval loss", "o-")]),
    ("kl", "KL(policy || reference)", [("kl", "KL", "-")]),
    ("accuracy", "preference accuracy", [("accuracy", "train", "-"), ("eval_accuracy", "held-out", "o-")]),
]


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """The run's panels from ``run_dir/metrics.jsonl``, side by side; returns the PNG path (default
    ``run_dir/<first panel>.png``)."""
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} not found: is {run} a run directory?")
    rows = read_metrics(metrics)
    panels = []
    for title, ylabel, series in PANELS:
        curves = [(label, style, [(r["step"], r[k]) for r in rows if k in r]) for k, label, style in series]
        curves = [c for c in curves if c[2]]
        if curves:
            panels.append((title, ylabel, curves))
    if not panels:
        raise ValueError(f"{metrics} has no values to plot (loss, reward, kl or accuracy)")
    if panels[0][0] == "reward" and len(panels) > 2:
        panels = panels[:1] + [p for p in panels[1:] if p[0] == "kl"]  # RLHF: reward and KL
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("llmkit plot needs matplotlib: pip install 'llmkit[plot]'") from e
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), dpi=120, squeeze=False)
    for ax, (title, ylabel, curves) in zip(axes[0], panels):
        for label, style, points in curves:
            ax.plot(*zip(*points), style, label=label, lw=1.3, ms=4)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{run.name}: {title}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(out) if out else run / f"{panels[0][0]}.png"
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path
