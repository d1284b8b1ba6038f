"""What every RLHF job shares with ``llmkit train``: the step loop (``llmkit.train.loop``: the
resolved config in ``out_dir``, ``metrics.jsonl``, a progress bar, stopping on SIGINT / SIGTERM,
all-or-nothing steps) and the checkpoints that ``--resume`` continues exactly (the one writer of
``llmkit.train.checkpoint``; PPO's value head beside the model as ``value_head.safetensors``; with
``lora``, the adapters in place of the model, beside a pointer to the frozen base).

A job's step is a function of its step number (its prompts or pairs and its sampling seeds are), so
a checkpoint needs no data position, and a run killed at any moment (even with ``kill -9``) resumes
from its newest checkpoint with the same metrics as an uninterrupted run (the wall-clock ones
apart). A resumed run takes its settings from the config given now (``FIXED_ON_RESUME`` lists what
it cannot change) and its state from the checkpoint.

Data parallel (``parallel.dp``, see data_parallel.py): every rank runs the loop; rank 0 alone draws the
progress bar, writes ``metrics.jsonl`` and the checkpoints (the state is the same on every rank),
and the ranks agree on a signal before each step, so they stop after the same one. The checkpoint
is the one-process run's, so ``--resume`` may change ``parallel.dp``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from llmkit.models.llama import LlamaTokenizer
from llmkit.train import checkpoint
from llmkit.train.config import apply_lora_section
from llmkit.train.loop import Loop, build_schedule
from llmkit.train.ranks import DataParallel

from .data import step_rows

TIMINGS = ("gen_s", "train_s", "sync_s", "gen_tokens_per_s", "step_s")  # wall-clock metrics

# What a resumed RLHF run cannot change, and why (see llmkit.train.config.resume_changes).
FIXED_ON_RESUME: dict[str, str] = {
    "algorithm": "the checkpoint holds that algorithm's trained layers and optimizer state",
    "model": "the checkpoint's weights are that model's, and the reference is its start",
    "optim.name": "the checkpoint holds that optimizer's state",
    "lora": "the checkpoint's adapters and optimizer state have those shapes",
    "train.seed": "it chose the prompts, pairs and samples of the steps already taken",
}


class Run(Loop):
    """A job's loop; subclasses set ``model``, ``tokenizer`` and ``optimizer``, then call
    :meth:`setup`, and implement :meth:`train_step`."""

    desc = "rlhf"
    timings = TIMINGS
    eval_at_end = True  # offline jobs evaluate after the last step
    fixed_on_resume = FIXED_ON_RESUME

    def __init__(self, cfg: Any, resume: bool = False, quiet: bool = False) -> None:
        self.cfg, self.quiet = cfg, quiet
        self.dp = self.ranks = DataParallel.join(cfg.parallel.dp)
        self.out = Path(cfg.out_dir)
        self.step = 0
        self.extra_layers = {}
        self.resumed_from = checkpoint.latest(self.out) if resume else None
        self.resume_changes: list[str] = []
        self.base_pointer: dict[str, Any] | None = None  # a LoRA run's frozen base (checkpoint.base_pointer)
        self.src = checkpoint.model_dir(cfg.model.init_from)  # the model the job starts from
        self.tokenizer = LlamaTokenizer.from_pretrained(self.src)

    def add_adapters(self, model: Any) -> None:
        """With a ``lora`` section: freeze ``model`` (loaded from ``self.src``) and add the section's
        adapters; the checkpoints then hold them alone (PEFT's files) beside a pointer to ``src``,
        and the rollouts' engine, traced from the model, runs them in its programs."""
        if self.cfg.lora is not None:
            apply_lora_section(model, self.cfg.lora, self.cfg.train.seed)
            self.base_pointer = checkpoint.base_pointer(self.src)

    def run_state(self) -> checkpoint.RunState:
        state = super().run_state()
        state.base = self.base_pointer
        return state

    def written(self) -> str:
        if self.base_pointer is None:
            return super().written()
        final = checkpoint.checkpoint_dir(self.out, self.step)
        return f"adapter in {final / checkpoint.ADAPTER} (llmkit checkpoint merge-lora {final} --out DIR)"

    def setup(self) -> None:
        """After the subclass built its parts: the schedule, resume, config and metrics."""
        self.schedule = build_schedule(self.cfg, self.optimizer)
        self.start(self.check_resume(self.resumed_from) if self.resumed_from is not None else None)

    def train_step(self) -> dict[str, Any]:
        """Run step ``self.step`` (0-based); return its metrics."""
        raise NotImplementedError

    def compute_step(self) -> dict[str, Any]:
        return self.train_step()

    def dp_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """A step's statistics, on each rank its rows' share of the whole batch's, summed over the
        ranks (``grad_norm``, of the summed gradients, is the whole batch's on every rank)."""
        keys = [k for k in stats if k != "grad_norm"]
        return {**stats, **dict(zip(keys, self.dp.sum([stats[k] for k in keys], "step stats").tolist()))}

    def step_pairs(self) -> list:
        """This rank's share of the step's preference pairs (the offline jobs' ``train_pairs``)."""
        t = self.cfg.train
        pairs = step_rows(self.train_pairs, t.batch_size, t.seed, self.step)
        return pairs[self.dp.rows(len(pairs))]

    def update(self, *arrays: Any) -> dict[str, float]:
        """The compiled update ``step_fn`` on this rank's arrays: its statistics (the whole batch's,
        ``dp_stats``) and ``train_s``, the slowest rank's time."""
        t0 = time.perf_counter()
        out = self.step_fn(*arrays)
        row = self.dp_stats({k: float(v) for k, v in out.items() if k != "logp"})
        row["train_s"] = float(self.dp.max([time.perf_counter() - t0], "train_s")[0])
        return row
