"""What every RLHF job shares with ``llmkit train``: the resolved config in ``out_dir``,
``metrics.jsonl``, a progress bar, stopping on SIGINT / SIGTERM, and checkpoints that ``--resume``
continues exactly (the layout and helpers of ``llmkit.train.checkpoint``).

    out_dir/checkpoints/step-00000100/
        model/                    the policy (or reward model): Hugging Face layout + tokenizer.model
        <extra>.safetensors       other trained layers (PPO's value head)
        optimizer.safetensors     the optimizer's moments
        trainer_state.json        step, optimizer groups, schedule, and the config
        COMPLETE                  written last: a checkpoint without it does not count

A job's step is a function of its step number (its prompts or pairs and its sampling seeds are), so
a checkpoint needs no data position or RNG state, and a run killed at any moment (even with
``kill -9``) resumes from its newest checkpoint with the same metrics as an uninterrupted run (the
wall-clock ones apart). As in ``llmkit train``: a step is all or nothing (a first signal lets it
finish, a second one rolls it back), a resumed run takes its settings from the config given now
(``FIXED_ON_RESUME`` lists what it cannot change) and its state from the checkpoint.

Data parallel (``parallel.dp``, see data_parallel.py): every rank runs this loop; rank 0 alone draws
the progress bar, writes ``metrics.jsonl`` and the checkpoints (the state is the same on every
rank), and the ranks agree on a signal before each step, so they stop after the same one. The
checkpoint is the one-process run's, so ``--resume`` may change ``parallel.dp``.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

import llmkit.framework as lf
from llmkit.framework import nn, optim
from llmkit.framework.files import atomic_dir, atomic_write
from llmkit.train import checkpoint
from llmkit.train.checkpoint import COMPLETE, OPTIMIZER, TRAINER_STATE, ResumeError
from llmkit.train.config import ConfigError, dump_config, resume_changes
from llmkit.train.metrics import MetricsLog
from llmkit.train.trainer import SCHEDULES, Interrupted, StopSignals

from .data_parallel import DataParallel

TIMINGS = ("gen_s", "train_s", "sync_s", "gen_tokens_per_s", "step_s")  # wall-clock metrics

# What a resumed RLHF run cannot change, and why (see llmkit.train.config.resume_changes).
FIXED_ON_RESUME: dict[str, str] = {
    "algorithm": "the checkpoint holds that algorithm's trained layers and optimizer state",
    "model": "the checkpoint's weights are that model's, and the reference is its start",
    "optim.name": "the checkpoint holds that optimizer's state",
    "train.seed": "it chose the prompts, pairs and samples of the steps already taken",
}


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
    """A job's loop; subclasses set ``model``, ``tokenizer`` and ``optimizer``, then call
    :meth:`setup`, and implement :meth:`train_step`."""

    desc = "rlhf"
    shown: tuple[str, ...] = ()  # metrics on the progress bar
    extra_layers: dict[str, nn.Layer]  # trained layers besides the model, saved as <name>.safetensors

    def __init__(self, cfg: Any, resume: bool = False, quiet: bool = False) -> None:
        self.cfg, self.quiet = cfg, quiet
        self.dp = DataParallel.join(cfg.parallel.dp)
        self.out = Path(cfg.out_dir)
        self.step = 0
        self.extra_layers = {}
        self.resumed_from: Path | None = checkpoint.latest(self.out) if resume else None
        self.resume_changes: list[str] = []

    def setup(self) -> None:
        """After the subclass built its parts: the schedule, resume, config and metrics."""
        self.schedule = SCHEDULES[self.cfg.lr_schedule.name](
            self.optimizer, self.cfg.lr_schedule, self.cfg.train.steps
        )
        layers = [self.model, *self.extra_layers.values()]
        # what a step rebinds: held before each step so that an aborted one can be rolled back
        self._state = [
            *(p for layer in layers for p in layer.parameters()),
            *(v for state in self.optimizer.states for v in state.values()),
            *self.optimizer.lr_tensors,
            self.optimizer.step_count,
        ]
        self._saved_step: int | None = None
        if self.resumed_from is not None:
            self.load_checkpoint(self.resumed_from)
            self._saved_step = self.step
        self.metrics: MetricsLog | None = None
        if self.dp.is_rank0:  # rank 0 alone writes
            self.out.mkdir(parents=True, exist_ok=True)
            dump_config(self.cfg, self.out / "config.yaml")
            self.metrics = MetricsLog(self.out / "metrics.jsonl", truncate_after=self.step)

    def train_step(self) -> dict[str, Any]:
        """Run step ``self.step`` (0-based); return its metrics."""
        raise NotImplementedError

    def dp_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """A step's statistics, on each rank its rows' share of the whole batch's, summed over the
        ranks (``grad_norm``, of the summed gradients, is the whole batch's on every rank)."""
        keys = [k for k in stats if k != "grad_norm"]
        return {**stats, **dict(zip(keys, self.dp.sum([stats[k] for k in keys], "step stats").tolist()))}

    def rolled_back(self) -> None:
        """After an aborted step's state was restored (the engine must forget what it cached)."""

    def evaluate(self) -> dict[str, Any]:
        """Held-out metrics, every ``train.eval_every`` steps and after the last (offline jobs)."""
        return {}

    def finish(self) -> None:
        """After the last step."""

    # ---- the loop ------------------------------------------------------------------------------------
    def _step(self, stop: StopSignals) -> dict[str, Any]:
        """One step, all or nothing: a KeyboardInterrupt inside restores the state before it."""
        lr = self.optimizer.param_groups[0]["lr"]
        before = [t.detach() for t in self._state]  # arrays are rebound, never written: a snapshot
        t0 = time.perf_counter()
        try:
            with self._abortable(stop):
                row = self.train_step()
        except KeyboardInterrupt:
            for t, value in zip(self._state, before, strict=True):
                t.set_value(value)
            self.optimizer.zero_grad()
            self.rolled_back()
            raise
        bad = next((k for k in ("loss", "grad_norm") if k in row and not math.isfinite(row[k])), None)
        if bad is not None:
            raise FloatingPointError(f"{bad} became {row[bad]} at step {self.step + 1}; lower optim.lr?")
        self.schedule.step()
        self.step += 1
        return {"step": self.step, **row, "lr": lr, "step_s": time.perf_counter() - t0}

    def _abortable(self, stop: StopSignals) -> contextlib.AbstractContextManager[None]:
        """A second signal aborts a step or evaluation, except with several ranks: one rank
        leaving a collective would leave the others waiting, so there every signal waits for the
        step's end (as ``llmkit train`` over MPI)."""
        return stop.abortable() if self.dp.size == 1 else contextlib.nullcontext()

    def _stopping(self, stop: StopSignals) -> bool:
        """Whether to stop before the next step; the ranks agree (a signal may reach one first)."""
        agreed = int(self.dp.max([stop.signum or 0], "stop signal")[0])
        stop.signum = stop.signum or agreed or None
        return agreed != 0

    def fit(self, stop: StopSignals | None = None) -> dict[str, Any]:
        """Run to ``train.steps``. On SIGINT or SIGTERM: finish the step in flight (roll it back on a
        second signal), save a checkpoint and raise ``Interrupted``. ``stop``: signals already
        handled by the caller (the main thread's, shared by ranks run on threads)."""
        t = self.cfg.train
        bar = tqdm(
            total=t.steps,
            initial=self.step,
            desc=self.desc + (f" x{self.dp.size}" if self.dp.size > 1 else ""),
            unit="step",
            disable=self.quiet or not self.dp.is_rank0,
            dynamic_ncols=True,
        )
        last: dict[str, Any] = {}
        with StopSignals() if stop is None else contextlib.nullcontext(stop) as stop:
            try:
                while self.step < t.steps and not self._stopping(stop):
                    row = self._step(stop)
                    if self.step == t.steps or (t.eval_every and self.step % t.eval_every == 0):
                        with self._abortable(stop):
                            row.update(self.evaluate())
                    if self.metrics is not None and (self.step % t.log_every == 0 or self.step == t.steps):
                        self.metrics.write(row)
                    last.update(row)
                    bar.set_postfix({k: _fmt(last[k]) for k in self.shown if k in last}, refresh=False)
                    bar.update(1)
                    if t.save_every and self.step % t.save_every == 0 and self.step < t.steps:
                        self.save_checkpoint()
            except KeyboardInterrupt:  # a second signal (or one outside the main thread)
                stop.signum = stop.signum or signal.SIGINT
            finally:
                bar.close()
            path = self.save_checkpoint()  # signals stay deferred: a save is never cut short
        if stop.signum is not None:
            raise Interrupted(stop.signum, self.step, path)
        self.finish()
        return last

    # ---- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """The run's state at ``self.step`` (once per step, by rank 0), atomically; the newest
        ``keep_last`` kept."""
        path = checkpoint.checkpoint_dir(self.out, self.step)
        if self._saved_step == self.step or not self.dp.is_rank0:
            return path
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
            atomic_write(tmp / COMPLETE, f"step {self.step}\n")  # the commit marker, last
        self._saved_step = self.step
        for old in checkpoint.checkpoints(self.out)[: -self.cfg.train.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def load_checkpoint(self, path: Path) -> None:
        """The state of checkpoint ``path``, with this run's settings (optimizer hyperparameters,
        schedule); ConfigError names a setting that cannot change, ResumeError a bad file."""
        try:
            state = json.loads((path / TRAINER_STATE).read_text())
            step, saved_config = int(state["step"]), state["config"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ResumeError(f"{path / TRAINER_STATE}: unreadable ({e!r})") from None
        self.resume_changes = [
            f"{k} {a} -> {b}" for k, a, b in resume_changes(saved_config, self.cfg, FIXED_ON_RESUME)
        ]
        if self.cfg.train.steps < step:
            raise ConfigError(f"train.steps ({self.cfg.train.steps}) is below the step of {path} ({step})")
        loaded = type(self.model).from_pretrained(path / "model")
        if loaded.config.to_dict() != self.model.config.to_dict():
            raise ResumeError(
                f"{path / 'model'}: the checkpoint's model config differs from this run's model"
            )
        opt = self.optimizer
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        try:
            opt.load_state_dict(optim.unflatten_state_dict(lf.load(path / OPTIMIZER), state["optimizer"]))
        except (ValueError, KeyError) as e:
            raise ResumeError(f"{path / OPTIMIZER}: {e}") from None
        for group, h in zip(opt.param_groups, hyper, strict=True):
            group.update(h)  # this run's lr, betas, weight decay (a resumed run may change them)
        self.model.load_state_dict(loaded.state_dict())
        for name, layer in self.extra_layers.items():
            layer.load_state_dict(lf.load(path / f"{name}.safetensors"))
        # the schedule is a closed form of the step: this run's settings, the checkpoint's step
        self.schedule.load_state_dict({**self.schedule.state_dict(), "last_step": step})
        self.step = step

    def final_model_dir(self) -> Path:
        return checkpoint.checkpoint_dir(self.out, self.step) / "model"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)
