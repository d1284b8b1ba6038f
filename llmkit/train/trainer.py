"""The training loop: ``Trainer(cfg).fit()``.

One step = ``grad_accum`` micro-batches (forward, backward), global-norm clipping, an optimizer
step and a schedule step. Every ``log_every`` steps a line goes to ``metrics.jsonl`` (step, loss,
lr, tokens/s, MFU...); every ``eval_every`` steps the validation loss and perplexity; every
``save_every`` steps (and at the end, and on SIGINT or SIGTERM) a checkpoint that ``--resume``
continues exactly (checkpoint.py).

A step is all or nothing. Its batches are drawn by position and the sampler moves only when the
step is done; a signal stops training only between steps (the step in flight finishes), and a
second one aborts the step in flight, which is rolled back. So a checkpoint's weights, optimizer,
schedule, data position and RNG always describe the same step.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import llmkit.framework as lf
from llmkit.framework import optim
from llmkit.framework.distributed.plan import PlanError
from llmkit.generate import generate
from llmkit.infer.sampling import SamplingParams
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
from llmkit.models.llama.parallel import check_plan

from . import checkpoint
from .config import (
    ConfigError,
    TrainConfig,
    dump_config,
    resolve_model_config,
    resume_changes,
    validate_against_model,
)
from .corpus import builtin_tokenizer
from .data import BatchSampler, eval_batches, load_token_data
from .metrics import MetricsLog, matmul_peak_flops


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


def build_tokenizer(cfg: TrainConfig) -> LlamaTokenizer:
    if cfg.tokenizer.path == "builtin":
        try:
            return builtin_tokenizer(cfg.tokenizer.vocab_size, cache_dir=cfg.data.cache_dir)
        except ValueError as e:  # sentencepiece cannot make that many pieces from the corpus
            raise ConfigError(f"tokenizer.vocab_size: {e}") from None
    return LlamaTokenizer.from_pretrained(cfg.tokenizer.path)


def check_out_dir(out: Path) -> None:
    """out_dir must be a directory, or creatable as one (no file in its place or on its path)."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"out_dir {str(out)!r}: {str(existing)!r} is a file, not a directory")


def build_optimizer(cfg: TrainConfig, model: LlamaForCausalLM) -> optim.Optimizer:
    """AdamW/SGD with weight decay on weight matrices only (not norms, biases or gains)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    o = cfg.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if o.name == "adamw":
        return optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return optim.SGD(groups, lr=o.lr, momentum=o.momentum)


SCHEDULES = {
    "constant": lambda opt, s, steps: optim.ConstantLR(opt, warmup_steps=s.warmup_steps),
    "cosine": lambda opt, s, steps: optim.WarmupCosine(opt, s.warmup_steps, steps, s.min_lr_ratio),
    "linear": lambda opt, s, steps: optim.LinearDecay(opt, s.warmup_steps, steps, s.min_lr_ratio),
}


class Trainer:
    """Builds everything a run needs from its config, then ``fit()`` trains."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, quiet: bool = False) -> None:
        """``resume``: continue from the newest checkpoint in ``cfg.out_dir``, with the settings of
        ``cfg``; ``resumed_from`` and ``resume_changes`` then say from where and what changed."""
        self.cfg, self.quiet = cfg, quiet
        t = cfg.train
        lf.seed(t.seed)
        try:
            lf.set_device(t.device)
        except RuntimeError as e:  # no cupy, no CUDA device: the config asked for what is not here
            raise ConfigError(f"train.device: {e}") from e
        self.out = Path(cfg.out_dir)
        check_out_dir(self.out)
        self.resumed_from: Path | None = checkpoint.latest(self.out) if resume else None
        self.resume_changes: list[str] = []
        saved = self._check_resume(self.resumed_from) if self.resumed_from is not None else None
        self.plan = cfg.parallel.build()
        if not self.plan.is_trivial:
            raise ConfigError(
                f"parallel: {self.plan.describe()} needs {self.plan.world_size} ranks; training runs in "
                "one process until the distributed eager world lands (set parallel.dp and parallel.tp to 1)"
            )
        self.tokenizer = build_tokenizer(cfg)
        self.model_config: LlamaConfig = resolve_model_config(cfg, self.tokenizer.vocab_size)
        validate_against_model(cfg, self.model_config)
        self.data = load_token_data(
            cfg.data.sources, self.tokenizer, cfg.data.val_fraction, cfg.data.cache_dir
        )
        self.sampler = BatchSampler(self.data.train, t.batch_size, t.seq_len, seed=t.seed)
        if cfg.model.init_from is not None:
            self.model = LlamaForCausalLM.from_pretrained(cfg.model.init_from)
        else:
            self.model = LlamaForCausalLM(self.model_config)
        try:
            check_plan(self.plan, self.model)
        except PlanError as e:
            raise ConfigError(f"parallel.plan: {e}") from None
        if t.dtype != "float32":
            self.model.to(t.dtype)
        self.optimizer = build_optimizer(cfg, self.model)
        self.schedule = SCHEDULES[cfg.schedule.name](self.optimizer, cfg.schedule, t.steps)
        self.step = 0
        self.tokens_seen = 0
        self.flops_per_token = self.model_config.flops_per_token(t.seq_len)
        self.peak_flops = matmul_peak_flops(t.device)
        if t.recompute:
            for layer in self.model.model.layers:
                layer.recompute()
        self.step_fn = self._static_step() if t.mode == "static" else self._eager_step
        # What a step rebinds: held before each step so that an aborted one can be rolled back.
        self._state = [
            *self.model.parameters(),
            *(v for state in self.optimizer.states for v in state.values()),
            *self.optimizer.lr_tensors,
            self.optimizer.step_count,
        ]
        self._saved_step: int | None = None
        if saved is not None:
            checkpoint.load(self, self.resumed_from, saved)
            self._saved_step = self.step
            was, now = saved.optimizer.param_groups[0]["lr"], self.optimizer.param_groups[0]["lr"]
            if now != was:
                self.resume_changes.append(f"lr at step {self.step} {was:.4g} -> {now:.4g}")
        self.out.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.out / "config.yaml")
        self.metrics = MetricsLog(self.out / "metrics.jsonl", truncate_after=self.step)

    def _check_resume(self, path: Path) -> checkpoint.TrainerState:
        """Read the checkpoint's state; refuse the config changes that cannot apply, list the rest."""
        saved = checkpoint.read_state(path)
        if saved.config is not None:
            self.resume_changes = [f"{k} {a} -> {b}" for k, a, b in resume_changes(saved.config, self.cfg)]
        if self.cfg.train.steps < saved.step:
            steps = self.cfg.train.steps
            raise ConfigError(f"train.steps ({steps}) is below the step of {path} ({saved.step})")
        return saved

    # ---- one step ------------------------------------------------------------------------------
    def _eager_step(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float]:
        """Forward/backward over the micro-batches, clip, update: (mean loss, grad norm)."""
        total = 0.0
        for x, y in batches:
            loss = self.model.loss(lf.tensor(x), lf.tensor(y)) / len(batches)
            loss.backward()
            total += loss.item()
        params = self.model.parameters()
        clip = self.cfg.optim.grad_clip
        norm = optim.clip_grad_norm_(params, clip if clip is not None else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total, float(norm.item())

    def state_names(self) -> dict[int, str]:
        """Readable names of every tensor a traced step captures (for programs and errors)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        names.update({id(b): n for n, b in self.model.named_buffers()})
        for p, state in zip(self.optimizer.params, self.optimizer.states):
            for k, v in state.items():
                names[id(v)] = f"optim.{names.get(id(p), 'param')}.{k}"
        for i, lr in enumerate(self.optimizer.lr_tensors):
            names[id(lr)] = f"optim.lr{i}"
        names[id(self.optimizer.step_count)] = "optim.step"
        return names

    def _static_step(self):
        """The whole step — micro-batches, backward, clipping, update — as one traced program."""
        from llmkit.framework import jit

        t = self.cfg.train
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip is not None else math.inf
        params = self.model.parameters()

        def step(xs, ys):
            total = None
            for a in range(t.grad_accum):  # unrolled: grad_accum is a config constant
                loss = self.model.loss(xs[a], ys[a]) / t.grad_accum
                loss.backward()
                total = loss if total is None else total + loss
            norm = optim.clip_grad_norm_(params, clip)
            self.optimizer.step()
            self.optimizer.zero_grad()
            return total, norm

        spec = jit.InputSpec([t.grad_accum, "B", "S"], "int64")
        compiled = jit.to_static(step, input_spec=[spec, spec], compiler=t.compiler, names=self.state_names())
        self.static_step = compiled

        def run(batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float]:
            self.optimizer.sync_lr()
            loss, norm = compiled(np.stack([x for x, _ in batches]), np.stack([y for _, y in batches]))
            return float(loss.item()), float(norm.item())

        return run

    @lf.no_grad()
    def evaluate(self) -> float:
        t = self.cfg.train
        losses = [
            self.model.loss(lf.tensor(x), lf.tensor(y)).item()
            for x, y in eval_batches(self.data.val, t.eval_steps, t.batch_size, t.seq_len)
        ]
        return float(np.mean(losses))

    # ---- the loop --------------------------------------------------------------------------------
    def train_step(self, stop: StopSignals | None = None) -> tuple[float, float, float]:
        """One optimizer step, all or nothing: (loss, grad norm, lr it ran at).

        The rebound state is held before the step runs (``set_value`` and static programs rebind
        arrays, never write into them, so holding them is a snapshot): a KeyboardInterrupt anywhere
        inside restores the state of the step before and propagates.
        """
        ga = self.cfg.train.grad_accum
        first = self.sampler.step
        batches = [self.sampler.batch(i) for i in range(first, first + ga)]
        lr = self.optimizer.param_groups[0]["lr"]
        before, rng = [t.detach() for t in self._state], lf.backend.get_rng_state()
        try:
            with stop.abortable() if stop is not None else contextlib.nullcontext():
                loss, gnorm = self.step_fn(batches)
        except KeyboardInterrupt:
            for t, value in zip(self._state, before, strict=True):
                t.set_value(value)
            lf.backend.set_rng_state(rng)
            self.optimizer.zero_grad()
            raise
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {self.step + 1}; lower optim.lr?")
        self.sampler.step = first + ga
        self.schedule.step()
        self.step += 1
        self.tokens_seen += ga * self.cfg.train.batch_size * self.cfg.train.seq_len
        return loss, gnorm, lr

    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps``. On SIGINT or SIGTERM: finish the step in flight (roll it back on
        a second signal), save a checkpoint and raise ``Interrupted``."""
        t = self.cfg.train
        bar = tqdm(
            total=t.steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=self.quiet,
            dynamic_ncols=True,
        )
        last: dict[str, Any] = {}
        window_t, window_tokens = time.perf_counter(), 0
        with StopSignals() as stop:
            try:
                while self.step < t.steps and stop.signum is None:
                    tokens = self.tokens_seen
                    loss, gnorm, lr = self.train_step(stop)
                    window_tokens += self.tokens_seen - tokens
                    row: dict[str, Any] = {}
                    if self.step % t.log_every == 0 or self.step == t.steps:
                        dt = time.perf_counter() - window_t
                        tps = window_tokens / dt if dt > 0 else 0.0
                        row = {
                            "step": self.step,
                            "loss": loss,
                            "lr": lr,
                            "grad_norm": gnorm,
                            "tokens_per_s": tps,
                            "mfu": tps * self.flops_per_token / self.peak_flops,
                            "tokens": self.tokens_seen,
                        }
                        window_t, window_tokens = time.perf_counter(), 0
                    if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                        try:
                            with stop.abortable():
                                val = self.evaluate()
                        except KeyboardInterrupt:  # the step is done: keep its line
                            if row:
                                self.metrics.write(row)
                            raise
                        row.update(step=self.step, eval_loss=val, eval_ppl=math.exp(min(val, 50.0)))
                        window_t = time.perf_counter()  # eval time is not training throughput
                    if row:
                        self.metrics.write(row)
                        last.update(row)
                        bar.set_postfix(
                            {
                                k: _fmt(last[k])
                                for k in ("loss", "lr", "tokens_per_s", "mfu", "eval_loss")
                                if k in last
                            },
                            refresh=False,
                        )
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
        sample = self.sample_text()
        (self.out / "sample.txt").write_text(sample + "\n")
        if not self.quiet:
            print(f"sample: {sample!r}")
        return last

    def sample_text(self, prompt: str = "The", max_new_tokens: int = 48) -> str:
        ids = self.tokenizer.encode(prompt, add_bos=True)
        room = self.model_config.max_position_embeddings - len(ids)
        new = generate(
            self.model,
            [ids],
            min(max_new_tokens, room),
            SamplingParams(temperature=0.8, top_k=40, seed=0),
            eos_token_id=self.tokenizer.eos_id,
        )[0]
        return prompt + self.tokenizer.decode(new)

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Save the run at ``self.step`` (once per step) and prune to the newest ``keep_last``."""
        if self._saved_step != self.step:
            checkpoint.save(self)
            self._saved_step = self.step
        return checkpoint.checkpoint_dir(self.out, self.step)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
