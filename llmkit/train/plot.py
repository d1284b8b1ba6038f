"""A job's run as a PNG (matplotlib, the ``plot`` extra): ``llmkit plot RUN [RUN ...]``.

Each job leaves one file that describes its run, and a table maps that file to the run's panels:

| job | file | panels |
|---|---|---|
| ``llmkit train`` | ``metrics.jsonl`` | loss (train and eval) |
| ``llmkit rlhf`` | ``metrics.jsonl`` | reward and KL (GRPO, RLOO, PPO); loss, accuracy (DPO, reward model) |
| ``llmkit quantize`` | ``quant_report.json`` | perplexity (float and quantized) and weight bytes |

One run gives one row of panels (``RUN/<first panel>.png``: ``loss.png``, ``reward.png``,
``perplexity.png``); several runs, one row each, in one figure (the whole pipeline).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmkit.framework.files import atomic_path

from .metrics import METRICS, QUANT_REPORT, read_metrics

# (panel title, y label, [(metric, label, style)]) of metrics.jsonl; the first panel with data names the file
PANELS: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("reward", "reward", [("reward_mean", "mean reward", "-")]),
    ("loss", "loss (nats/token)", [("loss", "train loss", "-"), ("eval_loss", "eval loss", "o-")]),
    ("kl", "KL(policy || reference)", [("kl", "KL", "-")]),
    ("accuracy", "preference accuracy", [("accuracy", "train", "-"), ("eval_accuracy", "held-out", "o-")]),
]


class PlotError(ValueError):
    """A run directory with nothing to plot, or a report that is not one (printed as one line)."""


@dataclass
class Panel:
    """One plot, ``name`` the file a run's figure is named after when it comes first. ``curves``:
    ``data`` is [(label, style, [(step, value)])]; ``bars``: ``data`` is (categories, [(series
    label, [value per category], [annotation per category])])."""

    name: str
    title: str
    ylabel: str
    kind: str
    data: Any


def metric_panels(path: Path) -> list[Panel]:
    """Training and RLHF runs: a panel of ``PANELS`` for each that the run logged (RLHF: reward, KL)."""
    rows = read_metrics(path)
    panels = []
    for title, ylabel, series in PANELS:
        curves = [(label, style, [(r["step"], r[k]) for r in rows if k in r]) for k, label, style in series]
        curves = [c for c in curves if c[2]]
        if curves:
            panels.append(Panel(title, title, ylabel, "curves", curves))
    if not panels:
        raise PlotError(f"{path} has no values to plot (loss, reward, kl or accuracy)")
    if panels[0].name == "reward" and len(panels) > 2:
        panels = panels[:1] + [p for p in panels[1:] if p.name == "kl"]  # RLHF: reward and KL
    return panels


def quant_panels(path: Path) -> list[Panel]:
    """A quantized model: perplexity of the float and the quantized model on the same held-out
    windows (with the mean KL and top-1 agreement), and the weights' bytes."""
    try:
        r = json.loads(path.read_text())
        qc, ppl, size = r["quantization_config"], r["perplexity"], r["bytes"]
        fp, qp = float(ppl["float"]), float(ppl["quant"])
        group = f"g{qc['group_size']}" if qc["group_size"] > 0 else "per-channel"
        name = f"int{qc['bits']} {group} {qc['method']}"
        kl, top1, tokens = float(r["kl"]), float(r["top1"]), int(r["eval"]["tokens"])
        mb = [[size[k] / 1e6 for k in (f"layers_{s}", f"model_{s}")] for s in ("float", "quant")]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlotError(f"{path}: not a quantization report ({type(e).__name__}: {e})") from None
    change = f"{qp / fp - 1:+.2%}"
    perplexity = Panel(
        "perplexity",
        f"perplexity, {tokens:,} held-out tokens\nmean KL {kl:.3g} nats/token, top-1 agreement {top1:.1%}",
        "perplexity",
        "bars",
        (["held-out split"], [("float32", [fp], [f"{fp:.3f}"]), (name, [qp], [f"{qp:.3f} ({change})"])]),
    )
    size_series = [
        (label, v, [f"{x:.2f} MB" for x in v]) for label, v in zip(["float32", name], mb, strict=True)
    ]
    sizes = Panel("weights", "weights", "MB", "bars", (["quantized linears", "whole model"], size_series))
    return [perplexity, sizes]


# the file a job leaves in its directory -> its panels (the first file found wins)
JOBS: list[tuple[str, Callable[[Path], list[Panel]]]] = [
    (METRICS, metric_panels),
    (QUANT_REPORT, quant_panels),
]


def run_panels(run_dir: str | os.PathLike[str]) -> list[Panel]:
    run = Path(run_dir)
    for name, panels in JOBS:
        if (run / name).is_file():
            return panels(run / name)
    files = " or ".join(name for name, _ in JOBS)
    raise FileNotFoundError(f"{run}: no {files}; is it the directory of a run?")


def _curves(ax: Any, p: Panel) -> None:
    for label, style, points in p.data:
        ax.plot(*zip(*points), style, label=label, lw=1.3, ms=4)
    ax.set_xlabel("step")
    ax.legend()


def _bars(ax: Any, p: Panel) -> None:
    categories, series = p.data
    width = 0.8 / len(series)
    for i, (label, values, notes) in enumerate(series):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))]
        ax.bar_label(ax.bar(xs, values, width * 0.9, label=label), notes, fontsize=8)
    ax.set_xticks(range(len(categories)), categories)
    ax.margins(y=0.15)
    ax.legend(loc="lower right")


DRAW = {"curves": _curves, "bars": _bars}


def plot_runs(run_dirs: list[str | os.PathLike[str]], out: str | os.PathLike[str] | None = None) -> Path:
    """One row of panels per run, in one PNG; returns its path (default: one run's
    ``RUN/<first panel>.png``, several runs' ``pipeline.png`` beside the first)."""
    if not run_dirs:
        raise PlotError("no run directory to plot")
    runs = [Path(r) for r in run_dirs]
    rows = [run_panels(r) for r in runs]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("llmkit plot needs matplotlib: pip install 'llmkit[plot]'") from e
    cols = max(map(len, rows))
    fig, axes = plt.subplots(len(rows), cols, figsize=(6 * cols, 3.8 * len(rows)), dpi=100, squeeze=False)
    for run, panels, row in zip(runs, rows, axes, strict=True):
        for ax, p in zip(row, panels):
            DRAW[p.kind](ax, p)
            ax.set_ylabel(p.ylabel)
            ax.set_title(f"{run.name}: {p.title}", fontsize=10)
            ax.grid(alpha=0.3)
        for ax in row[len(panels) :]:
            ax.axis("off")
    fig.tight_layout()
    if out is None:
        out = runs[0] / f"{rows[0][0].name}.png" if len(runs) == 1 else runs[0].parent / "pipeline.png"
    path = Path(out)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path
