"""The step loop of every job: ``llmkit train`` (trainer.py) and each ``llmkit rlhf`` job
(rlhf/run.py) are a :class:`Loop` that supplies its step; the loop does the rest::

    while step < train.steps and no rank saw a signal:    the ranks agree before each step
        row = job.compute_step()          all or nothing: an abort restores the state before it
        schedule.step(); step += 1; job.commit()
        every log_every steps (and the last):  job.log_row(...) -> metrics.jsonl, progress bar
        every eval_every steps (and the last):  job.evaluate()
        every save_every steps:                 a checkpoint (checkpoint.py)
    a checkpoint at the end, or on SIGINT / SIGTERM (then ``Interrupted``); job.finish()

A step is all or nothing. A job's batches are a function of the step number (and of a data position
that moves only in ``commit``), so a signal stops the run only between steps: the first one lets
the step in flight finish, a second one aborts it (a KeyboardInterrupt inside ``compute_step``) and
the tensors the step rebinds, held before it ran, are put back. So a checkpoint's weights,
optimizer, schedule, data position and RNG always describe the same step, and ``--resume``
continues exactly. With several processes every signal waits for the step's end (one rank leaving
a collective would leave the others waiting).
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

import llmkit.framework as lf
from llmkit.framework import nn, optim

from . import checkpoint
from .config import FIXED_ON_RESUME, ConfigError, dump_config, resume_changes
from .metrics import MetricsLog
from .ranks import DataParallel


class Interrupted(KeyboardInterrupt):
    """``fit()`` stopped by a signal; the checkpoint of ``step`` was saved at ``path``."""

    def __init__(self, signum: int, step: int, path: Path) -> None:
        super().__init__(f"{signal.Signals(signum).name} at step {step}")
        self.signum, self.step, self.path = signum, step, path


class StopSignals:
    """SIGINT and SIGTERM while training, as a context manager around ``fit``'s loop.

    The first signal is recorded (``signum``): the loop finishes the step in flight, saves and
    stops. A second signal while an ``abortable()`` block runs (a step, an evaluation) raises
    KeyboardInterrupt there; anywhere else it is recorded too. Outside the main thread, where Python
    cannot install handlers, signals keep their usual behaviour.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._abortable = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and self._abortable:
            self._abortable = False  # one KeyboardInterrupt, never a second inside the rollback
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    @contextlib.contextmanager
    def abortable(self) -> Iterator[None]:
        self._abortable = True
        try:
            yield
        finally:
            self._abortable = False


# ---- the optimizer and its schedule, as every job builds them --------------------------------------
def decay_groups(*layers: nn.Layer) -> list[tuple[list[tuple[str, lf.Tensor]], bool]]:
    """The optimizer's groups in its order, as ((name, parameter) pairs, decayed): weight matrices
    (decayed), then norms, biases and gains; empty groups and frozen parameters (a LoRA run's base)
    left out."""
    named = [(n, p) for layer in layers for n, p in layer.named_parameters() if p.requires_grad]
    groups = [[(n, p) for n, p in named if p.ndim >= 2], [(n, p) for n, p in named if p.ndim < 2]]
    return [(g, decayed) for g, decayed in zip(groups, (True, False)) if g]


def build_optimizer(o: Any, *layers: nn.Layer) -> optim.Optimizer:
    """AdamW/SGD (``o``: the config's ``optim`` section) over the parameters of ``layers``, with
    weight decay on weight matrices only (not norms, biases or gains)."""
    groups = [
        {"params": [p for _, p in named], "weight_decay": o.weight_decay if decayed else 0.0}
        for named, decayed in decay_groups(*layers)
    ]
    if o.name == "adamw":
        return optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return optim.SGD(groups, lr=o.lr, momentum=o.momentum)


SCHEDULES = {
    "constant": lambda opt, s, steps: optim.ConstantLR(opt, warmup_steps=s.warmup_steps),
    "cosine": lambda opt, s, steps: optim.WarmupCosine(opt, s.warmup_steps, steps, s.min_lr_ratio),
    "linear": lambda opt, s, steps: optim.LinearDecay(opt, s.warmup_steps, steps, s.min_lr_ratio),
}


def build_schedule(cfg: Any, opt: optim.Optimizer) -> optim.LRScheduler:
    """The lr schedule of ``cfg.schedule`` over ``cfg.train.steps``."""
    return SCHEDULES[cfg.schedule.name](opt, cfg.schedule, cfg.train.steps)


def fmt(v: Any) -> str:
    """A metric as the progress bar shows it."""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


class Loop:
    """A job's state and the loop over its steps. A job sets ``cfg``, ``quiet``, ``out``,
    ``ranks``, ``model``, ``tokenizer``, ``optimizer`` and ``schedule``, calls :meth:`start` once
    they are built, and implements :meth:`compute_step` (and the other hooks it needs)."""

    desc = "train"  # the progress bar's label
    shown: tuple[str, ...] = ()  # metrics on the progress bar
    timings: tuple[str, ...] = ()  # wall-clock metrics: left out of the final summary line
    eval_at_end = False  # evaluate after the last step even with train.eval_every: 0
    fixed_on_resume: dict[str, str] = FIXED_ON_RESUME  # what --resume cannot change, and why
    one_update_per_step = True  # one optimizer step a step (checked on resume); False: it varies
    state_keys: tuple[str, ...] = ()  # the job's own entries of trainer_state.json, required on resume

    cfg: Any
    quiet: bool
    out: Path
    ranks: DataParallel  # the processes (or threads) that run this loop together
    model: Any
    tokenizer: Any
    optimizer: optim.Optimizer
    schedule: optim.LRScheduler
    step: int = 0
    resumed_from: Path | None = None
    resume_changes: list[str]
    extra_layers: dict[str, nn.Layer]  # trained layers besides the model, saved as <name>.safetensors

    # ---- the job's hooks -----------------------------------------------------------------------------
    def compute_step(self) -> dict[str, Any]:
        """Run step ``self.step`` (0-based) and return its metrics (``loss``, ``grad_norm``... must be
        finite); a KeyboardInterrupt inside it rolls it back."""
        raise NotImplementedError

    def commit(self) -> None:
        """After a step that completed: move what is not a tensor (a data position) past it."""

    def rolled_back(self) -> None:
        """After an aborted step's tensors were restored (an engine must forget what it cached)."""

    def log_row(self, row: dict[str, Any], seconds: float, steps: int) -> dict[str, Any]:
        """The ``metrics.jsonl`` line of a logged step: ``row`` is its ``run_step`` metrics;
        ``seconds`` and ``steps``: the training time and steps since the last logged one."""
        return row

    def evaluate(self) -> dict[str, Any]:
        """Held-out metrics, every ``train.eval_every`` steps and after the last (every rank calls it)."""
        return {}

    def finish(self) -> None:
        """After the last step (and its checkpoint)."""

    def postfix(self) -> dict[str, str]:
        """What the progress bar shows besides the ``shown`` metrics."""
        return {}

    def checkpoint_extras(self) -> dict[str, Any]:
        """The job's own entries of ``trainer_state.json`` (``state_keys``), at this step."""
        return {}

    def restore_extras(self, state: checkpoint.TrainerState) -> None:
        """The job's own state from a checkpoint's ``trainer_state.json``."""

    def run_state(self) -> checkpoint.RunState:
        """What a checkpoint holds of this run, and how this process writes and reads it."""
        return checkpoint.RunState(
            self.out,
            self.step,
            self.cfg,
            self.model,
            self.tokenizer,
            self.optimizer,
            self.schedule,
            layers=self.extra_layers,
            extras=self.checkpoint_extras(),
            writer=self.ranks.is_rank0,
        )

    @property
    def can_abort(self) -> bool:
        """Whether a second signal may abort a step: not with several processes (a rank leaving a
        collective would leave the others waiting; every signal there waits for the step's end)."""
        return self.ranks.size == 1

    @property
    def is_rank0(self) -> bool:
        return self.ranks.is_rank0

    # ---- building --------------------------------------------------------------------------------------
    def check_resume(self, path: Path) -> checkpoint.TrainerState:
        """Read checkpoint ``path``'s state; refuse the config changes that cannot apply (ConfigError
        naming the key), list the rest in ``resume_changes``."""
        saved = checkpoint.read_state(path, self.one_update_per_step, self.state_keys)
        if saved.config is not None:
            changes = resume_changes(saved.config, self.cfg, self.fixed_on_resume)
            self.resume_changes = [f"{k} {a} -> {b}" for k, a, b in changes]
        if self.cfg.train.steps < saved.step:
            steps = self.cfg.train.steps
            raise ConfigError(f"train.steps ({steps}) is below the step of {path} ({saved.step})")
        return saved

    def rollback_tensors(self) -> list[lf.Tensor]:
        """What a step rebinds: held before each step so that an aborted one can be rolled back."""
        layers = [self.model, *self.extra_layers.values()]
        return [
            *(p for layer in layers for p in layer.parameters()),
            *(v for state in self.optimizer.states for v in state.values()),
            *self.optimizer.lr_tensors,
            self.optimizer.step_count,
        ]

    def start(self, saved: checkpoint.TrainerState | None = None) -> None:
        """Once the job's parts are built: the rollback state, the checkpoint's state (``saved``,
        read from ``resumed_from``), then rank 0 writes the resolved config and opens the metrics."""
        self._state = self.rollback_tensors()
        self._saved_step: int | None = None
        if saved is not None:
            assert self.resumed_from is not None
            if self.is_rank0:  # what a run killed while it saved left behind
                checkpoint.remove_staging(self.out)
            self.load_checkpoint(self.resumed_from, saved)
            self._saved_step = self.step
        self.metrics: MetricsLog | None = None
        if self.is_rank0:  # rank 0 alone writes
            self.out.mkdir(parents=True, exist_ok=True)
            dump_config(self.cfg, self.out / "config.yaml")
            self.metrics = MetricsLog(self.out / "metrics.jsonl", truncate_after=self.step)

    # ---- the loop --------------------------------------------------------------------------------------
    def run_step(self, stop: StopSignals | None = None) -> dict[str, Any]:
        """One step, all or nothing: its metrics with ``step``, the ``lr`` it ran at and ``step_s``.

        The rebound state is held before the step runs (``set_value`` and static programs rebind
        arrays, never write into them, so holding them is a snapshot): a KeyboardInterrupt anywhere
        inside restores the state of the step before and propagates.
        """
        lr = self.optimizer.param_groups[0]["lr"]
        before, rng = [t.detach() for t in self._state], lf.backend.get_rng_state()
        t0 = time.perf_counter()
        try:
            with self._abortable(stop):
                row = self.compute_step()
        except KeyboardInterrupt:
            for t, value in zip(self._state, before, strict=True):
                t.set_value(value)
            lf.backend.set_rng_state(rng)
            self.optimizer.zero_grad()
            self.rolled_back()
            raise
        bad = next((k for k in ("loss", "grad_norm") if k in row and not math.isfinite(row[k])), None)
        if bad is not None:
            raise FloatingPointError(f"{bad} became {row[bad]} at step {self.step + 1}; lower optim.lr?")
        self.schedule.step()
        self.step += 1
        self.commit()
        return {"step": self.step, **row, "lr": lr, "step_s": time.perf_counter() - t0}

    def _abortable(self, stop: StopSignals | None) -> contextlib.AbstractContextManager[None]:
        return stop.abortable() if stop is not None and self.can_abort else contextlib.nullcontext()

    def _stopping(self, stop: StopSignals) -> bool:
        """Whether to stop before the next step; the ranks agree (a signal may reach one process a
        step before another), so they all save the same step."""
        agreed = int(self.ranks.max([stop.signum or 0], "stop signal")[0])
        stop.signum = stop.signum or agreed or None
        return stop.signum is not None

    def fit(self, stop: StopSignals | None = None) -> dict[str, Any]:
        """Run to ``train.steps``; return the last logged metrics. On SIGINT or SIGTERM: finish the
        step in flight (roll it back on a second signal), save a checkpoint and raise
        ``Interrupted``. ``stop``: signals already handled by the caller (the main thread's, shared
        by ranks run on threads)."""
        t = self.cfg.train
        bar = tqdm(
            total=t.steps,
            initial=self.step,
            desc=self.desc + (f" x{self.ranks.size}" if self.ranks.size > 1 else ""),
            unit="step",
            disable=self.quiet or not self.is_rank0,
            dynamic_ncols=True,
        )
        last: dict[str, Any] = {}
        window_t, window_steps = time.perf_counter(), 0
        with StopSignals() if stop is None else contextlib.nullcontext(stop) as stop:
            try:
                while self.step < t.steps and not self._stopping(stop):
                    row = self.run_step(stop)
                    window_steps += 1
                    logged: dict[str, Any] = {}
                    if self.step % t.log_every == 0 or self.step == t.steps:
                        logged = self.log_row(row, time.perf_counter() - window_t, window_steps)
                        window_t, window_steps = time.perf_counter(), 0
                    if (t.eval_every and self.step % t.eval_every == 0) or (
                        self.step == t.steps and (t.eval_every or self.eval_at_end)
                    ):
                        try:
                            with self._abortable(stop):
                                held_out = self.evaluate()
                        except KeyboardInterrupt:  # the step is done: keep its line
                            if logged and self.metrics is not None:
                                self.metrics.write(logged)
                            raise
                        if held_out:
                            logged = {**logged, "step": self.step, **held_out}
                        window_t = time.perf_counter()  # eval time is not training throughput
                    if logged:
                        if self.metrics is not None:
                            self.metrics.write(logged)
                        last.update(logged)
                        shown = {k: fmt(last[k]) for k in self.shown if k in last}
                        bar.set_postfix({**shown, **self.postfix()}, refresh=False)
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
        """Save the run at ``self.step`` (once per step; every rank calls this) and prune to the
        newest ``keep_last``."""
        if self._saved_step != self.step:
            checkpoint.save(self.run_state())
            self._saved_step = self.step
        return checkpoint.checkpoint_dir(self.out, self.step)

    def load_checkpoint(self, path: Path, saved: checkpoint.TrainerState) -> None:
        """The state of checkpoint ``path`` (``saved``: its checked trainer_state.json), with this
        run's settings (optimizer hyperparameters, schedule)."""
        self.load_report = checkpoint.load(self.run_state(), path, saved)
        self.restore_extras(saved)
        self.step = saved.step

    # ---- what the command line prints -------------------------------------------------------------------
    def report_start(self, say: Callable[..., None]) -> None:
        """Before ``fit``: where a resumed run continues from, and what its config changed."""
        if self.resumed_from is not None:
            say(f"resume: step {self.step} from {self.resumed_from}")
            say(f"resume: {', '.join(self.resume_changes) or 'the config is unchanged'}")

    def written(self) -> str:
        """The end of the final line: where the run's results are."""
        return f"model in {self.final_model_dir()}"

    def final_model_dir(self) -> Path:
        return checkpoint.checkpoint_dir(self.out, self.step) / "model"

    def summary(self, last: dict[str, Any]) -> str:
        """The final line's metrics: ``k=v`` of every float but the wall-clock ones."""
        shown = {k: v for k, v in last.items() if isinstance(v, float) and k not in self.timings}
        return ", ".join(f"{k}={v:.4g}" for k, v in shown.items())
