"""The training loop: ``Trainer(cfg).fit()``.

One step = ``grad_accum`` micro-batches (forward, backward), global-norm clipping, an optimizer
step and a schedule step. Every ``log_every`` steps a line goes to ``metrics.jsonl`` (step, loss,
lr, tokens/s, MFU...); every ``eval_every`` steps the validation loss and perplexity; every
``save_every`` steps (and at the end, and on Ctrl-C) a checkpoint that ``--resume`` continues
exactly: weights in the Hugging Face layout, optimizer and schedule state, data position and RNG.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import llmkit.framework as lf
from llmkit.framework import optim
from llmkit.framework.files import atomic_dir
from llmkit.infer.sampling import SamplingParams
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
from llmkit.models.llama.generate import generate

from .config import ConfigError, TrainConfig, dump_config, resolve_model_config, validate_against_model
from .corpus import builtin_tokenizer
from .data import BatchSampler, eval_batches, load_token_data
from .metrics import MetricsLog, matmul_peak_flops

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"


def build_tokenizer(cfg: TrainConfig) -> LlamaTokenizer:
    if cfg.tokenizer.path == "builtin":
        return builtin_tokenizer(cfg.tokenizer.vocab_size, cache_dir=cfg.data.cache_dir)
    return LlamaTokenizer.from_pretrained(cfg.tokenizer.path)


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
        self.cfg, self.quiet = cfg, quiet
        t = cfg.train
        lf.seed(t.seed)
        try:
            lf.set_device(t.device)
        except RuntimeError as e:  # no cupy, no CUDA device: the config asked for what is not here
            raise ConfigError(f"train.device: {e}") from e
        self.out = Path(cfg.out_dir)
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
        if resume:
            self._resume()
        self.out.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.out / "config.yaml")
        self.metrics = MetricsLog(self.out / "metrics.jsonl", truncate_after=self.step)

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
    def fit(self) -> dict[str, Any]:
        t = self.cfg.train
        tokens_per_step = t.batch_size * t.seq_len * t.grad_accum
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
        interrupted = False
        previous = signal.getsignal(signal.SIGINT)
        try:
            while self.step < t.steps:
                lr = self.optimizer.param_groups[0]["lr"]
                batches = [next(self.sampler) for _ in range(t.grad_accum)]
                loss, gnorm = self.step_fn(batches)
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss became {loss} at step {self.step + 1}; lower optim.lr?")
                self.schedule.step()
                self.step += 1
                self.tokens_seen += tokens_per_step
                window_tokens += tokens_per_step
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
                    val = self.evaluate()
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
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
            signal.signal(signal.SIGINT, previous)
        # A second Ctrl-C while saving must not leave a half-written checkpoint: atomic_dir sees to it.
        self.save_checkpoint()
        if interrupted:
            raise KeyboardInterrupt
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
    def checkpoint_dir(self, step: int) -> Path:
        return self.out / CHECKPOINTS / f"step-{step:08d}"

    def save_checkpoint(self) -> Path:
        """Write the whole state of the run at ``self.step`` atomically; keep the newest ``keep_last``."""
        path = self.checkpoint_dir(self.step)
        with atomic_dir(path) as tmp:
            self.model.save_pretrained(tmp / "model")
            self.tokenizer.save_pretrained(tmp / "model")
            tensors, meta = optim.flatten_state_dict(self.optimizer.state_dict())
            lf.save(tensors, tmp / "optimizer.safetensors")
            state = {
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "optimizer": meta,
                "schedule": self.schedule.state_dict(),
                "sampler": self.sampler.state_dict(),
                "rng": lf.backend.get_rng_state(),
            }
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1))
        ckpts = sorted((self.out / CHECKPOINTS).glob("step-*"))
        for old in ckpts[: -self.cfg.train.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def _resume(self) -> None:
        ckpts = sorted((self.out / CHECKPOINTS).glob("step-*")) if (self.out / CHECKPOINTS).is_dir() else []
        if not ckpts:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.out / CHECKPOINTS}")
        self.load_checkpoint(ckpts[-1])

    def load_checkpoint(self, path: Path) -> None:
        state = json.loads((path / TRAINER_STATE).read_text())
        loaded = LlamaForCausalLM.from_pretrained(path / "model")
        if loaded.config.to_dict() != self.model_config.to_dict():
            raise ValueError(f"{path}: the checkpoint's model config differs from this run's config")
        self.model.load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(
            optim.unflatten_state_dict(lf.load(path / "optimizer.safetensors"), state["optimizer"])
        )
        self.schedule.load_state_dict(state["schedule"])
        self.sampler.load_state_dict(state["sampler"])
        lf.backend.set_rng_state(state["rng"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
