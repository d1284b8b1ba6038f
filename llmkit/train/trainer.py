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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework import nn, optim
from llmkit.framework.distributed.parallel_plan import PlanError
from llmkit.framework.distributed.parallelize import Parallelized
from llmkit.generate import generate
from llmkit.infer.sampling import SamplingParams
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
from llmkit.models.llama.sharding import apply_recompute, check_plan

from . import checkpoint
from .config import (
    ConfigError,
    TrainConfig,
    check_world,
    dump_config,
    resolve_model_config,
    resume_changes,
    validate_against_model,
)
from .corpus import builtin_tokenizer
from .data import BatchSampler, eval_batches, load_token_data
from .metrics import MetricsLog, matmul_peak_flops, peak_rss_bytes
from .pipeline_run import PipelineRun


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


def decay_groups(model: nn.Layer) -> list[tuple[list[str], bool]]:
    """The optimizer's groups in its order, as (parameter names, decayed): weight matrices (decayed),
    then norms, biases and gains; empty groups left out."""
    named = list(model.named_parameters())
    groups = [([n for n, p in named if p.ndim >= 2], True), ([n for n, p in named if p.ndim < 2], False)]
    return [g for g in groups if g[0]]


def build_optimizer(cfg: TrainConfig, model: nn.Layer) -> optim.Optimizer:
    """AdamW/SGD with weight decay on weight matrices only (not norms, biases or gains)."""
    o, params = cfg.optim, dict(model.named_parameters())
    groups = [
        {"params": [params[n] for n in names], "weight_decay": o.weight_decay if decayed else 0.0}
        for names, decayed in decay_groups(model)
    ]
    if o.name == "adamw":
        return optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return optim.SGD(groups, lr=o.lr, momentum=o.momentum)


def state_names(
    model: Any, optimizer: optim.Optimizer | None = None, extra: dict[str, Any] | None = None
) -> dict[int, str]:
    """Readable names of the tensors a traced step captures: parameters and buffers of ``model``
    (and of the ``extra`` layers, under their prefix), the optimizer's state, lr and step count."""
    names = {id(p): n for n, p in model.named_parameters()}
    names.update({id(b): n for n, b in model.named_buffers()})
    for prefix, layer in (extra or {}).items():
        names.update({id(p): f"{prefix}.{n}" for n, p in layer.named_parameters()})
    if optimizer is not None:
        for p, state in zip(optimizer.params, optimizer.states):
            for k, v in state.items():
                names[id(v)] = f"optim.{names.get(id(p), 'param')}.{k}"
        for i, lr in enumerate(optimizer.lr_tensors):
            names[id(lr)] = f"optim.lr{i}"
        names[id(optimizer.step_count)] = "optim.step"
    return names


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
        self.rank, self.backend = self._join_world()
        self.is_rank0 = self.rank == 0
        self.tokenizer = build_tokenizer(cfg)
        self.model_config: LlamaConfig = resolve_model_config(cfg, self.tokenizer.vocab_size)
        validate_against_model(cfg, self.model_config)
        self.data = load_token_data(
            cfg.data.sources, self.tokenizer, cfg.data.val_fraction, cfg.data.cache_dir
        )
        self.sampler = BatchSampler(self.data.train, t.batch_size, t.seq_len, t.seed, self.data.train_mask)
        # Weights about to be loaded (a checkpoint; a pretrained model over several ranks, each
        # reading its slices) are not initialized first: building the model keeps its memory untouched.
        load_init = cfg.model.init_from is not None and self.backend is not None and self.plan.pp == 1
        if cfg.model.init_from is not None and not load_init:
            self.model = LlamaForCausalLM.from_pretrained(cfg.model.init_from)
        else:
            with nn.init.skip_init() if saved is not None or load_init else contextlib.nullcontext():
                self.model = LlamaForCausalLM(self.model_config)
        try:
            check_plan(self.plan, self.model)
        except PlanError as e:
            raise ConfigError(f"parallel.plan: {e}") from None
        if t.dtype != "float32":
            self.model.to(t.dtype)
        apply_recompute(self.plan, self.model)  # before a pipeline takes the layers into its stages
        # The plan's layout: parameters placed (each from the full initial value every process made
        # alike, so every mesh starts from the single-process weights), then the optimizer's state.
        # A pipeline: each hosted pipeline rank's stages, with their own optimizer and schedule.
        self.par: Parallelized | None = None
        self.pipe: PipelineRun | None = None
        if self.plan.pp > 1:
            self.pipe = PipelineRun(
                self.model,
                self.plan,
                t.seq_len,
                lambda layer: build_optimizer(cfg, layer),
                lambda opt: SCHEDULES[cfg.lr_schedule.name](opt, cfg.lr_schedule, t.steps),
                [names for names, _ in decay_groups(self.model)],
                t.mode,
                t.compiler,
            )
            self.optimizer, self.schedule = self.pipe.first.optimizer, self.pipe.schedules
        else:
            self.par = None if self.backend is None else Parallelized(self.model, self.plan)
            self.optimizer = build_optimizer(cfg, self.model)
            if self.par is not None:
                self.par.shard_optimizer(self.optimizer)
            self.schedule = SCHEDULES[cfg.lr_schedule.name](self.optimizer, cfg.lr_schedule, t.steps)
        if load_init and saved is None:
            checkpoint.load_weights(self, Path(cfg.model.init_from))
        self.step = 0
        self.tokens_seen = 0
        self.flops_per_token = self.model_config.flops_per_token(t.seq_len)
        self.peak_flops = matmul_peak_flops(t.device) * self.plan.world_size
        self.state_bytes = 0  # parameter + gradient + optimizer bytes of the fullest rank, last step
        # on resume: (bytes the fullest rank read, bytes of the whole checkpoint, peak host memory)
        self.load_report: tuple[int, int, int] | None = None
        self.activation_bytes = 0  # the fullest rank's activation memory at the last step's peak
        if self.pipe is not None:
            self.step_fn = self._pipeline_step
        else:
            self.step_fn = self._static_step() if t.mode == "static" else self._eager_step
        # What a step rebinds: held before each step so that an aborted one can be rolled back (a
        # pipeline's step is never aborted: its ranks run on threads or processes, as over MPI).
        self._state = (
            []
            if self.pipe is not None
            else [
                *self.model.parameters(),
                *self._optimizer_state(),
                *self.optimizer.lr_tensors,
                self.optimizer.step_count,
            ]
        )
        self._saved_step: int | None = None
        if saved is not None:
            checkpoint.load(self, self.resumed_from, saved)
            self._saved_step = self.step
            was, now = saved.optimizer.param_groups[0]["lr"], self.optimizer.param_groups[0]["lr"]
            if now != was:
                self.resume_changes.append(f"lr at step {self.step} {was:.4g} -> {now:.4g}")
        self.metrics = None
        if self.is_rank0:  # rank 0 alone logs
            self.out.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.out / "config.yaml")
            self.metrics = MetricsLog(self.out / "metrics.jsonl", truncate_after=self.step)

    def _join_world(self) -> tuple[int, str | None]:
        """This process's rank and the backend (None: one process, no mesh). A plan of several ranks
        runs them as processes under mpiexec (one rank each), or all in this process (``sim``)."""
        launched = dist.comm.launched_by_mpi()
        if self.plan.is_trivial and not launched:
            return 0, None
        p = self.plan
        b = dist.init()
        if b.name == "sim" and b.world_size < p.world_size:  # one process simulates the whole mesh
            b = dist.init("sim", world_size=p.world_size)
        if b.name != "sim":
            check_world(self.cfg.parallel, b.world_size, "this run has {n} processes (mpiexec -n / --nproc)")
        return b.rank, b.name

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
    def place(self, read: Callable[[slice], tuple[np.ndarray, ...]]) -> tuple[lf.Tensor, ...]:
        """A global batch as the eager step takes it; ``read(rows)`` gives those rows of it (each
        data-parallel rank reads only its own)."""
        if self.par is not None:
            return self.par.batch(read, self.cfg.train.batch_size)
        return tuple(lf.tensor(a) for a in read(slice(None)))

    def draw(self, step: int) -> tuple[Any, Any]:
        """Training batch ``step``: arrays for a static step in one process, else placed tensors."""
        if self.pipe is not None or (self.par is None and self.cfg.train.mode == "static"):
            return self.sampler.batch(step)
        return self.place(lambda rows: self.sampler.batch(step, rows))

    def value(self, t: lf.Tensor) -> float:
        """A 0-d tensor's value (a distributed one's global value: every rank calls this)."""
        return float((t if t.is_concrete else dist.unshard(t)).item())

    def _eager_step(self, batches: list[tuple[lf.Tensor, lf.Tensor]]) -> tuple[float, float]:
        """Forward/backward over the micro-batches, clip, update: (mean loss, grad norm)."""
        total = 0.0
        for i, (x, y) in enumerate(batches):
            loss = self.model.loss(x, y) / len(batches)
            if i == 0:  # the tape's peak: the forward done, the backward not begun
                self.activation_bytes = lf.autograd.saved_bytes([loss])
            loss.backward()
            total += self.value(loss)
        params = self.model.parameters()
        if self.par is not None:
            self.par.reduce_grads()  # all-reduce, or reduce-scatter under ZeRO 2 and 3
            self.state_bytes = self.par.state_bytes()
        else:
            self.state_bytes = _nbytes([*params, *(p.grad for p in params), *self._optimizer_state()])
        clip = self.cfg.optim.grad_clip
        norm = optim.clip_grad_norm_(params, clip if clip is not None else math.inf)
        self.optimizer.step()
        if self.par is not None:
            self.par.settle()  # updated shards gathered back where the plan keeps them
        self.optimizer.zero_grad()
        return total, self.value(norm)

    def _pipeline_step(self, batches: list[tuple[Any, Any]]) -> tuple[float, float]:
        """The pipeline's step: every hosted rank's job list, gradient reduction, clipping, update."""
        assert self.pipe is not None and len(batches) == 1  # the pipeline's micro-batches accumulate
        clip = self.cfg.optim.grad_clip
        loss, norm, self.state_bytes = self.pipe.step(*batches[0], clip if clip is not None else math.inf)
        return loss, norm

    def _optimizer_state(self) -> list[lf.Tensor]:
        return [v for state in self.optimizer.states for v in state.values()]

    def state_names(self) -> dict[int, str]:
        """Readable names of every tensor a traced step captures (for programs and errors)."""
        return state_names(self.model, self.optimizer)

    def _static_step(self):
        """The whole step — micro-batches, backward, gradient reduction, clipping, update — as one
        traced program; over several ranks, partitioned into one program per rank."""
        from llmkit.framework import jit

        t, par = self.cfg.train, self.par
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip is not None else math.inf
        params = self.model.parameters()

        def step(*batch):  # x0, y0, x1, y1, ...: the micro-batches
            total = None
            for a in range(t.grad_accum):  # unrolled: grad_accum is a config constant
                loss = self.model.loss(batch[2 * a], batch[2 * a + 1]) / t.grad_accum
                loss.backward()
                total = loss if total is None else total + loss
            if par is not None:
                par.reduce_grads()
            norm = optim.clip_grad_norm_(params, clip)
            self.optimizer.step()
            if par is not None:
                par.settle()
            self.optimizer.zero_grad()
            return total, norm

        # One program: symbolic batch dims in one process; the placed batches' shapes over several
        # ranks (partitioned programs take static shapes).
        spec = None if par is not None else [jit.InputSpec(["B", "S"], "int64")] * (2 * t.grad_accum)
        compiled = jit.to_static(step, input_spec=spec, compiler=t.compiler, names=self.state_names())
        self.static_step = compiled
        # gradients live inside the program: count them in the layout they are reduced to
        shapes = {n: p.shape for n, p in self.model.named_parameters()}
        state = self.optimizer.states[0]  # every parameter's state alike: its kind and dtype
        moments, itemsize = len(state), next(iter(state.values())).dtype.itemsize if state else 4
        self.state_bytes = self.plan.state_bytes(shapes, params[0].dtype.itemsize, moments, itemsize)

        def run(batches: list[tuple[Any, Any]]) -> tuple[float, float]:
            self.optimizer.sync_lr()
            args = [a for xy in batches for a in xy]
            loss, norm = compiled(*args)
            if not self.activation_bytes:
                self.activation_bytes = _program_peak(compiled.get_concrete_program(*args), args)
            count = self.optimizer.step_count
            if not count.is_concrete:  # a partitioned program returns it replicated on the mesh
                count.set_value(dist.unshard(count))
            return self.value(loss), self.value(norm)

        return run

    @lf.no_grad()
    def evaluate(self) -> float:
        """Mean loss of the validation batches (every rank takes part; rank 0 reports it)."""
        t = self.cfg.train
        batches = eval_batches(self.data.val, t.eval_steps, t.batch_size, t.seq_len, self.data.val_mask)
        if self.pipe is not None:
            return float(np.mean([self.pipe.evaluate(x, y) for x, y in batches]))
        losses = [
            self.value(self.model.loss(*self.place(lambda rows, x=x, y=y: (x[rows], y[rows]))))
            for x, y in batches
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
        batches = [self.draw(i) for i in range(first, first + ga)]
        lr = self.optimizer.param_groups[0]["lr"]
        before, rng = [t.detach() for t in self._state], lf.backend.get_rng_state()
        try:
            with self._abortable(stop):
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

    def _abortable(self, stop: StopSignals | None) -> contextlib.AbstractContextManager[None]:
        """A second signal aborts a step or evaluation, except over MPI: one rank leaving a
        collective would leave the others waiting, so there every signal waits for the step's end."""
        if stop is None or self.backend == "mpi" or self.pipe is not None:
            return contextlib.nullcontext()
        return stop.abortable()

    def _stopping(self, stop: StopSignals) -> bool:
        """Whether to stop before the next step; over MPI the ranks agree (a signal may reach one
        process a step before another), so they all save the same step."""
        stop.signum = stop.signum or self._most(stop.signum or 0, "stop signal") or None
        return stop.signum is not None

    def _most(self, value: int, what: str) -> int:
        """The largest ``value`` of the processes (a collective over MPI; elsewhere this one's)."""
        if self.backend != "mpi":
            return value
        comm = dist.get_backend()
        got = comm.all_reduce(
            tuple(range(comm.world_size)), {comm.rank: np.array([value], np.int64)}, "max", what
        )
        return int(got[comm.rank][0])

    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps``. On SIGINT or SIGTERM: finish the step in flight (roll it back on
        a second signal), save a checkpoint and raise ``Interrupted``."""
        t = self.cfg.train
        bar = tqdm(
            total=t.steps,
            initial=self.step,
            desc="train" if self.backend is None else f"train x{self.plan.world_size}",
            unit="step",
            disable=self.quiet or not self.is_rank0,
            dynamic_ncols=True,
        )
        last: dict[str, Any] = {}
        window_t, window_tokens = time.perf_counter(), 0
        with StopSignals() as stop:
            try:
                while self.step < t.steps and not self._stopping(stop):
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
                            "state_bytes_per_rank": self.state_bytes,
                            "activation_bytes_per_rank": self.activation_bytes,
                            "peak_rss_bytes": self._most(peak_rss_bytes(), "peak memory"),
                        }
                        window_t, window_tokens = time.perf_counter(), 0
                    if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                        try:
                            with self._abortable(stop):
                                val = self.evaluate()
                        except KeyboardInterrupt:  # the step is done: keep its line
                            if row and self.metrics is not None:
                                self.metrics.write(row)
                            raise
                        row.update(step=self.step, eval_loss=val, eval_ppl=math.exp(min(val, 50.0)))
                        window_t = time.perf_counter()  # eval time is not training throughput
                    if row:
                        if self.metrics is not None:
                            self.metrics.write(row)
                        last.update(row)
                        shown = {
                            k: _fmt(last[k])
                            for k in ("loss", "lr", "tokens_per_s", "mfu", "eval_loss")
                            if k in last
                        }
                        bar.set_postfix(
                            {**shown, "mem/rank": f"{self.state_bytes / 2**20:.3g}MB"}, refresh=False
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
        if self.is_rank0:
            # Several ranks: rank 0 samples from the final checkpoint's model, joined from its pieces.
            model = self.model if self.backend is None else LlamaForCausalLM.from_pretrained(path / "model")
            sample = self.sample_text(model)
            (self.out / "sample.txt").write_text(sample + "\n")
            if not self.quiet:
                print(f"sample: {sample!r}")
        return last

    def sample_text(self, model: LlamaForCausalLM, prompt: str = "The", max_new_tokens: int = 48) -> str:
        ids = self.tokenizer.encode(prompt, add_bos=True)
        room = self.model_config.max_position_embeddings - len(ids)
        new = generate(
            model,
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


def _program_peak(cp: Any, args: list[Any]) -> int:
    """The intermediates' peak bytes of a traced step under its executor's liveness (the fullest
    rank this process runs, for a partitioned program)."""
    ex = cp.executor
    if hasattr(ex, "peak_bytes"):
        return ex.peak_bytes(ex.bind([getattr(a, "_data", a) for a in args] + [t._data for t in cp.captures]))
    hosted = dist.get_backend().hosted(ex.mesh.ranks)
    return max(ex.executor(r).peak_bytes() for r in hosted)


def _nbytes(tensors: list[Any]) -> int:
    return sum(t._data.nbytes for t in tensors if t is not None)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
