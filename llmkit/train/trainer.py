"""Language-model training: ``Trainer(cfg).fit()``, the step of the loop in loop.py.

One step = ``grad_accum`` micro-batches (forward, backward), global-norm clipping, an optimizer
step and a schedule step. Every ``log_every`` steps a line goes to ``metrics.jsonl`` (step, loss,
lr, tokens/s, MFU...); every ``eval_every`` steps the validation loss and perplexity; every
``save_every`` steps (and at the end, and on SIGINT or SIGTERM) a checkpoint that ``--resume``
continues exactly (checkpoint.py).

The batches are drawn by position and the sampler moves only when the step is done (``commit``),
so an aborted step, rolled back by the loop, leaves no trace.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework import nn, optim
from llmkit.framework.distributed.parallel_plan import PlanError
from llmkit.framework.distributed.parallelize import Parallelized
from llmkit.generate import generate
from llmkit.infer.sampling import SamplingParams
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
from llmkit.models.llama.lora import load_adapter
from llmkit.models.llama.sharding import apply_recompute, check_plan

from . import checkpoint
from .config import (
    ConfigError,
    TrainConfig,
    apply_lora_section,
    check_world,
    resolve_model_config,
    validate_against_model,
)
from .corpus import builtin_tokenizer
from .data import BatchSampler, eval_batches, load_token_data
from .loop import Interrupted, Loop, StopSignals, build_optimizer, build_schedule, decay_groups
from .metrics import matmul_peak_flops, peak_rss_bytes
from .pipeline_run import PipelineRun, state_bytes
from .ranks import DataParallel

__all__ = ["Interrupted", "StopSignals", "Trainer", "state_names"]  # Interrupted: the loop's, re-exported
BASE_DIR = "base"  # a LoRA run from a preset: its random frozen base, under out_dir


def build_tokenizer(cfg: TrainConfig) -> LlamaTokenizer:
    if cfg.tokenizer.path == "builtin":
        try:
            return builtin_tokenizer(
                cfg.tokenizer.vocab_size, cache_dir=cfg.data.cache_dir, kind=cfg.tokenizer.kind
            )
        except ValueError as e:  # sentencepiece cannot make that many pieces from the corpus
            raise ConfigError(f"tokenizer.vocab_size: {e}") from None
    return LlamaTokenizer.from_pretrained(cfg.tokenizer.path)


def check_out_dir(out: Path) -> None:
    """out_dir must be a directory, or creatable as one (no file in its place or on its path)."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"out_dir {str(out)!r}: {str(existing)!r} is a file, not a directory")


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


class Trainer(Loop):
    """Builds everything a run needs from its config, then ``fit()`` trains."""

    shown = ("loss", "lr", "tokens_per_s", "mfu", "eval_loss")
    state_keys = ("tokens_seen", "sampler", "rng")

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
        self.resumed_from = checkpoint.latest(self.out) if resume else None
        self.resume_changes: list[str] = []
        self.extra_layers = {}
        saved = self.check_resume(self.resumed_from) if self.resumed_from is not None else None
        self.plan = cfg.parallel.build()
        self.rank, self.backend = self._join_world()
        world = dist.get_backend().world_size if self.backend == "mpi" else 1
        self.ranks = DataParallel(self.rank, world, "train") if world > 1 else DataParallel(job="train")
        self.tokenizer = build_tokenizer(cfg)
        self.model_config: LlamaConfig = resolve_model_config(cfg, self.tokenizer.vocab_size)
        validate_against_model(cfg, self.model_config)
        d = cfg.data
        self.data = load_token_data(d.sources, self.tokenizer, d.val_fraction, d.cache_dir)
        self.sampler = BatchSampler(self.data.train, t.batch_size, t.seq_len, t.seed, self.data.train_mask)
        # Weights about to be loaded (a checkpoint; a pretrained model over several ranks, each
        # reading its slices) are not initialized first: building the model keeps its memory untouched.
        init = cfg.model.init_from
        load_init = (
            init is not None
            and self.backend is not None
            and self.plan.pp == 1
            and cfg.lora is None  # a LoRA run's base is read whole, then laid out with its adapters
        )
        base_dir = self._lora_base_dir(saved is not None)
        if base_dir is not None and base_dir.is_dir() and (init is not None or saved is not None):
            self.model = LlamaForCausalLM.from_pretrained(base_dir)  # a LoRA run's frozen base
        elif init is not None and not load_init:
            self.model = LlamaForCausalLM.from_pretrained(init)
        else:
            with nn.init.skip_init() if saved is not None or load_init else contextlib.nullcontext():
                self.model = LlamaForCausalLM(self.model_config)
        try:
            check_plan(self.plan, self.model)
        except PlanError as e:
            raise ConfigError(f"parallel.plan: {e}") from None
        if t.dtype != "float32":
            self.model.to(t.dtype)
        self.base_pointer: dict[str, Any] | None = None
        if base_dir is not None:
            self._add_adapters(base_dir)
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
                lambda layer: build_optimizer(cfg.optim, layer),
                lambda opt: build_schedule(cfg, opt),
                [[n for n, _ in named] for named, _ in decay_groups(self.model)],
                t.mode,
                t.compiler,
            )
            self.optimizer, self.schedule = self.pipe.first.optimizer, self.pipe.schedules
        else:
            self.par = None if self.backend is None else Parallelized(self.model, self.plan)
            self.optimizer = build_optimizer(cfg.optim, self.model)
            if self.par is not None:
                self.par.shard_optimizer(self.optimizer)
            self.schedule = build_schedule(cfg, self.optimizer)
        self.step = 0
        self.tokens_seen = 0
        self.clip = math.inf if cfg.optim.grad_clip is None else cfg.optim.grad_clip  # the grad-norm clip
        if load_init and saved is None:
            checkpoint.load_weights(self.run_state(), Path(init))
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
        self.start(saved)

    def _lora_base_dir(self, resuming: bool) -> Path | None:
        """A LoRA run's frozen base: ``model.init_from``, or (a preset) the run's ``base/``, written
        once when the run starts and read back on resume. None without ``lora``."""
        cfg = self.cfg
        if cfg.lora is None:
            return None
        if self.plan.pp > 1:
            raise ConfigError(
                "lora: adapters train with data and tensor parallelism and ZeRO, not yet in a "
                "pipeline; set parallel.pp to 1"
            )
        if cfg.model.init_from is not None:
            return Path(cfg.model.init_from)
        base = self.out / BASE_DIR
        if resuming and not (base / "config.json").is_file():
            raise checkpoint.ResumeError(f"--resume: {base} (the LoRA run's base model) is missing")
        return base

    def _add_adapters(self, base_dir: Path) -> None:
        """Freeze the model, add the ``lora`` section's adapters, and record the base they apply to
        (a preset's random base is written to ``base_dir`` first)."""
        cfg = self.cfg
        assert cfg.lora is not None
        # A fresh preset run (every rank made the base alike): rank 0 alone looks and writes. Every
        # rank reaches the barrier whatever it would see: one that looked after rank 0 wrote would
        # skip it and meet rank 0's barrier with its next collective.
        if self.ranks.is_rank0 and not (base_dir / "config.json").is_file():
            self.model.save_pretrained(base_dir)
            self.tokenizer.save_pretrained(base_dir)
        if self.backend == "mpi":
            dist.get_backend().barrier()  # written before the other ranks hash it
        apply_lora_section(self.model, cfg.lora, cfg.train.seed)
        self.base_pointer = checkpoint.base_pointer(base_dir)

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
        return total, self.value(self._update(measure=True))

    def _update(self, measure: bool = False) -> lf.Tensor:
        """The end of a step, eager or traced: gradients reduced over the ranks, clipped, the
        optimizer's step (``measure``: the rank's state bytes, with the reduced gradients); the norm."""
        params = self.model.parameters()
        if self.par is not None:
            self.par.reduce_grads()  # all-reduce, or reduce-scatter under ZeRO 2 and 3
        if measure:
            self.state_bytes = self.par.state_bytes() if self.par else state_bytes(0, params, self.optimizer)
        norm = optim.clip_grad_norm_([p for p in params if p.requires_grad], self.clip)  # LoRA: adapters
        self.optimizer.step()
        if self.par is not None:
            self.par.settle()  # updated shards gathered back where the plan keeps them
        self.optimizer.zero_grad()
        return norm

    def _pipeline_step(self, batches: list[tuple[Any, Any]]) -> tuple[float, float]:
        """The pipeline's step: every hosted rank's job list, gradient reduction, clipping, update."""
        assert self.pipe is not None and len(batches) == 1  # the pipeline's micro-batches accumulate
        loss, norm, self.state_bytes = self.pipe.step(*batches[0], self.clip)
        return loss, norm

    def _static_step(self):
        """The whole step — micro-batches, backward, gradient reduction, clipping, update — as one
        traced program; over several ranks, partitioned into one program per rank."""
        from llmkit.framework import jit

        t = self.cfg.train
        params = [p for p in self.model.parameters() if p.requires_grad]  # a LoRA run: its adapters

        def step(*batch):  # x0, y0, x1, y1, ...: the micro-batches
            total = None
            for a in range(t.grad_accum):  # unrolled: grad_accum is a config constant
                loss = self.model.loss(batch[2 * a], batch[2 * a + 1]) / t.grad_accum
                loss.backward()
                total = loss if total is None else total + loss
            return total, self._update()

        # One program: symbolic batch dims in one process; the placed batches' shapes over several
        # ranks (partitioned programs take static shapes).
        spec = None if self.par is not None else [jit.InputSpec(["B", "S"], "int64")] * (2 * t.grad_accum)
        names = state_names(self.model, self.optimizer)
        self.static_step = compiled = jit.to_static(step, input_spec=spec, compiler=t.compiler, names=names)
        # gradients live inside the program: count them in the layout they are reduced to
        named = self.model.named_parameters()
        shapes = {n: p.shape for n, p in named if p.requires_grad}  # a LoRA run: its adapters
        frozen = {n: p.shape for n, p in named if not p.requires_grad}  # and its base, weights only
        state = self.optimizer.states[0]  # every parameter's state alike: its kind and dtype
        moments, itemsize = len(state), next(iter(state.values())).dtype.itemsize if state else 4
        self.state_bytes = self.plan.state_bytes(shapes, params[0].dtype.itemsize, moments, itemsize, frozen)

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
    def evaluate(self) -> dict[str, float]:
        """Mean loss (and perplexity) of the validation batches (every rank takes part; rank 0
        reports it)."""
        t = self.cfg.train
        batches = eval_batches(self.data.val, t.eval_steps, t.batch_size, t.seq_len, self.data.val_mask)
        if self.pipe is not None:
            losses = [self.pipe.evaluate(x, y) for x, y in batches]
        else:  # each batch placed as it comes (each rank reads its rows)
            placed = (self.place(lambda rows, x=x, y=y: (x[rows], y[rows])) for x, y in batches)
            losses = [self.value(self.model.loss(*xy)) for xy in placed]
        val = float(np.mean(losses))
        return {"eval_loss": val, "eval_ppl": math.exp(min(val, 50.0))}

    # ---- the loop's hooks ------------------------------------------------------------------------------
    def rollback_tensors(self) -> list[lf.Tensor]:
        # a pipeline's step is never aborted: its ranks run on threads or processes, as over MPI
        return [] if self.pipe is not None else super().rollback_tensors()

    @property
    def can_abort(self) -> bool:
        return self.backend != "mpi" and self.pipe is None

    def compute_step(self) -> dict[str, Any]:
        ga = self.cfg.train.grad_accum
        first = self.sampler.step
        loss, gnorm = self.step_fn([self.draw(i) for i in range(first, first + ga)])
        return {"loss": loss, "grad_norm": gnorm}

    def commit(self) -> None:
        t = self.cfg.train
        self.sampler.step += t.grad_accum
        self.tokens_seen += t.grad_accum * t.batch_size * t.seq_len

    def train_step(self, stop: StopSignals | None = None) -> tuple[float, float, float]:
        """One optimizer step, all or nothing (``Loop.run_step``): (loss, grad norm, lr it ran at)."""
        row = self.run_step(stop)
        return row["loss"], row["grad_norm"], row["lr"]

    def log_row(self, row: dict[str, Any], seconds: float, steps: int) -> dict[str, Any]:
        t = self.cfg.train
        tps = steps * t.grad_accum * t.batch_size * t.seq_len / seconds if seconds > 0 else 0.0
        return {
            "step": self.step,
            **{k: row[k] for k in ("loss", "lr", "grad_norm")},
            "tokens_per_s": tps,
            "mfu": tps * self.flops_per_token / self.peak_flops,
            "tokens": self.tokens_seen,
            "state_bytes_per_rank": self.state_bytes,
            "activation_bytes_per_rank": self.activation_bytes,
            "peak_rss_bytes": int(self.ranks.max([peak_rss_bytes()], "peak memory")[0]),
        }

    def report_start(self, say: Callable[..., None]) -> None:
        if self.backend is not None:
            say(f"parallel: {self.plan.describe()} on {self.backend} ({self.plan.world_size} ranks)")
        if self.pipe is not None and not self.quiet:  # its stages and every rank's job list
            say(self.pipe.describe())
        super().report_start(say)
        if self.load_report is not None:
            read, total, rss = self.load_report
            mb = 2**20
            say(
                f"resume: read {read / mb:.3g} MB of {total / mb:.3g} MB per rank; "
                f"peak host memory {rss / mb:.0f} MB"
            )

    def written(self) -> str:
        return f"checkpoints and metrics.jsonl in {self.cfg.out_dir}"

    def postfix(self) -> dict[str, str]:
        return {"mem/rank": f"{self.state_bytes / 2**20:.3g}MB"}

    def finish(self) -> None:
        if self.is_rank0:
            # Several ranks: rank 0 samples from the final checkpoint's model, joined from its pieces.
            if self.backend is None:
                model = self.model
            elif self.base_pointer is not None:  # a LoRA run: its base, with the final adapters
                model = LlamaForCausalLM.from_pretrained(self.base_pointer["path"])
                load_adapter(model, checkpoint.checkpoint_dir(self.out, self.step) / checkpoint.ADAPTER)
            else:
                model = LlamaForCausalLM.from_pretrained(self.final_model_dir())
            sample = self.sample_text(model)
            (self.out / "sample.txt").write_text(sample + "\n")
            if not self.quiet:
                print(f"sample: {sample!r}")

    def sample_text(self, model: LlamaForCausalLM, prompt: str = "The", max_new_tokens: int = 48) -> str:
        ids = self.tokenizer.encode(prompt, add_bos=True)
        room = self.model_config.max_position_embeddings - len(ids)
        params = SamplingParams(temperature=0.8, top_k=40, seed=0)
        new = generate(model, [ids], min(max_new_tokens, room), params, eos_token_id=self.tokenizer.eos_id)[0]
        return prompt + self.tokenizer.decode(new)

    # ---- checkpoints -----------------------------------------------------------------------------
    def run_state(self) -> checkpoint.RunState:
        state = super().run_state()
        state.plan, state.par, state.pipe = self.plan, self.par, self.pipe
        state.sharded = self.backend is not None
        state.base = self.base_pointer
        return state

    def checkpoint_extras(self) -> dict[str, Any]:
        rng = lf.backend.get_rng_state()
        return {"tokens_seen": self.tokens_seen, "sampler": self.sampler.state_dict(), "rng": rng}

    def restore_extras(self, state: checkpoint.TrainerState) -> None:
        assert state.sampler is not None and state.tokens_seen is not None  # state_keys
        self.sampler.load_state_dict(state.sampler.model_dump())
        self.tokens_seen = state.tokens_seen
        was, now = state.optimizer.param_groups[0]["lr"], self.optimizer.param_groups[0]["lr"]
        if now != was:
            self.resume_changes.append(f"lr at step {state.step} {was:.4g} -> {now:.4g}")


def _program_peak(cp: Any, args: list[Any]) -> int:
    """The intermediates' peak bytes of a traced step under its executor's liveness (the fullest
    rank this process runs, for a partitioned program)."""
    ex = cp.executor
    if hasattr(ex, "peak_bytes"):
        return ex.peak_bytes(ex.bind([getattr(a, "_data", a) for a in args] + [t._data for t in cp.captures]))
    hosted = dist.get_backend().hosted(ex.mesh.ranks)
    return max(ex.executor(r).peak_bytes() for r in hosted)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
