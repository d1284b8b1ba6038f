"""What every RLHF job shares with ``llmkit train``: the resolved config in ``out_dir``,
``metrics.jsonl``, a progress bar, and checkpoints that ``--resume`` continues exactly.

    out_dir/checkpoints/step-00000100/
        model/                    the policy (or reward model): Hugging Face layout + tokenizer.model
        <extra>.safetensors       other trained layers (PPO's value head)
        optimizer.safetensors     the optimizer's moments
        trainer_state.json        step, optimizer groups, schedule, and the config

A job's step is a function of its step number (its prompts or pairs and its sampling seeds are), so
a checkpoint needs no data position or RNG state, and a run killed at any moment (even with
``kill -9``) resumes from its newest checkpoint with the same metrics as an uninterrupted run (the
wall-clock ones apart).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

import llmkit.framework as lf
from llmkit.framework import nn, optim
from llmkit.framework.files import atomic_dir
from llmkit.train.checkpoint import CHECKPOINTS, TRAINER_STATE
from llmkit.train.config import ConfigError, dump_config
from llmkit.train.metrics import MetricsLog
from llmkit.train.trainer import SCHEDULES

OPTIMIZER = "optimizer.safetensors"
TIMINGS = ("gen_s", "train_s", "sync_s", "gen_tokens_per_s", "step_s")  # wall-clock metrics


def model_dir(path: str | Path, key: str = "model.init_from") -> Path:
    """A Hugging Face model directory, or a run directory (``llmkit train``'s or ``llmkit rlhf``'s
    ``out_dir``) standing for its newest checkpoint's ``model/``."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    ckpts = sorted((p / CHECKPOINTS).glob("step-*/model")) if (p / CHECKPOINTS).is_dir() else []
    if ckpts:
        return ckpts[-1]
    if not p.exists():
        raise ConfigError(
            f"{key}: {str(path)!r} does not exist; train the model first "
            "(llmkit train configs/tiny.yaml writes runs/tiny) or point it at a checkpoint directory"
        )
    raise ConfigError(
        f"{key}: {str(path)!r} is neither a model directory (config.json) nor a run with checkpoints"
    )


def param_groups(layers: list[nn.Layer], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only, as ``llmkit train``'s optimizer."""
    decay = [p for layer in layers for p in layer.parameters() if p.ndim >= 2]
    rest = [p for layer in layers for p in layer.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(o: Any, layers: list[nn.Layer]) -> optim.Optimizer:
    groups = param_groups(layers, o.weight_decay)
    if o.name == "adamw":
        return optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return optim.SGD(groups, lr=o.lr, momentum=o.momentum)


class Run:
    """A job's loop; subclasses set ``model``, ``tokenizer``, ``optimizer`` and ``schedule`` (see
    :meth:`setup`) and implement :meth:`train_step`."""

    desc = "rlhf"
    shown: tuple[str, ...] = ()  # metrics on the progress bar
    extra_layers: dict[str, nn.Layer]  # trained layers besides the model, saved as <name>.safetensors

    def __init__(self, cfg: Any, resume: bool = False, quiet: bool = False) -> None:
        self.cfg, self.quiet = cfg, quiet
        self.out = Path(cfg.out_dir)
        self.step = 0
        self.extra_layers = {}

    def setup(self, resume: bool) -> None:
        """After the subclass built its parts: the optimizer's schedule, resume, config and metrics."""
        self.schedule = SCHEDULES[self.cfg.schedule.name](
            self.optimizer, self.cfg.schedule, self.cfg.train.steps
        )
        if resume:
            self.load_checkpoint(self.latest_checkpoint())
        self.out.mkdir(parents=True, exist_ok=True)
        dump_config(self.cfg, self.out / "config.yaml")
        self.metrics = MetricsLog(self.out / "metrics.jsonl", truncate_after=self.step)

    def train_step(self) -> dict[str, Any]:
        """Run step ``self.step`` (0-based); return its metrics."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, Any]:
        """Held-out metrics, every ``train.eval_every`` steps and after the last (offline jobs)."""
        return {}

    def finish(self) -> dict[str, Any]:
        """After the last step: a final row of metrics, if any."""
        return {}

    # ---- the loop ------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        t = self.cfg.train
        bar = tqdm(
            total=t.steps,
            initial=self.step,
            desc=self.desc,
            unit="step",
            disable=self.quiet,
            dynamic_ncols=True,
        )
        last: dict[str, Any] = {}
        interrupted = False
        try:
            while self.step < t.steps:
                lr = self.optimizer.param_groups[0]["lr"]
                t0 = time.perf_counter()
                row = self.train_step()
                self.schedule.step()
                self.step += 1
                if self.step == t.steps or (t.eval_every and self.step % t.eval_every == 0):
                    row.update(self.evaluate())
                row = {"step": self.step, **row, "lr": lr, "step_s": time.perf_counter() - t0}
                bad = next((k for k in ("loss", "grad_norm") if k in row and not math.isfinite(row[k])), None)
                if bad is not None:
                    raise FloatingPointError(f"{bad} became {row[bad]} at step {self.step}; lower optim.lr?")
                if self.step % t.log_every == 0 or self.step == t.steps:
                    self.metrics.write(row)
                last.update(row)
                bar.set_postfix({k: _fmt(last[k]) for k in self.shown if k in last}, refresh=False)
                bar.update(1)
                if t.save_every and self.step % t.save_every == 0 and self.step < t.steps:
                    self.save_checkpoint()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
        self.save_checkpoint()
        if interrupted:
            raise KeyboardInterrupt
        final = self.finish()
        if final:
            final = {"step": self.step, **final}
            self.metrics.write(final)
            last.update(final)
        return last

    # ---- checkpoints -----------------------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return self.out / CHECKPOINTS / f"step-{step:08d}"

    def latest_checkpoint(self) -> Path:
        found = sorted((self.out / CHECKPOINTS).glob("step-*")) if (self.out / CHECKPOINTS).is_dir() else []
        if not found:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.out / CHECKPOINTS}")
        return found[-1]

    def save_checkpoint(self) -> Path:
        """The run's state at ``self.step``, atomically; the newest ``keep_last`` are kept."""
        path = self.checkpoint_dir(self.step)
        with atomic_dir(path) as tmp:
            self.model.save_pretrained(tmp / "model")
            self.tokenizer.save_pretrained(tmp / "model")
            for name, layer in self.extra_layers.items():
                lf.save({k: v.numpy() for k, v in layer.state_dict().items()}, tmp / f"{name}.safetensors")
            tensors, meta = optim.flatten_state_dict(self.optimizer.state_dict())
            lf.save(tensors, tmp / OPTIMIZER)
            state = {
                "step": self.step,
                "optimizer": meta,
                "schedule": self.schedule.state_dict(),
                "config": self.cfg.model_dump(mode="json"),
            }
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1))
        for old in sorted((self.out / CHECKPOINTS).glob("step-*"))[: -self.cfg.train.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def load_checkpoint(self, path: Path) -> None:
        state = json.loads((path / TRAINER_STATE).read_text())
        loaded = type(self.model).from_pretrained(path / "model")
        if loaded.config.to_dict() != self.model.config.to_dict():
            raise ValueError(f"{path}: the checkpoint's model config differs from this run's model")
        self.model.load_state_dict(loaded.state_dict())
        for name, layer in self.extra_layers.items():
            layer.load_state_dict(lf.load(path / f"{name}.safetensors"))
        self.optimizer.load_state_dict(
            optim.unflatten_state_dict(lf.load(path / OPTIMIZER), state["optimizer"])
        )
        self.schedule.load_state_dict(state["schedule"])
        self.step = state["step"]

    def final_model_dir(self) -> Path:
        return self.checkpoint_dir(self.step) / "model"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)
