"""Training checkpoints: everything ``--resume`` needs to continue a run exactly.

    out_dir/checkpoints/step-00000600/
        model/                  weights, config.json and tokenizer.model (Hugging Face layout)
        optimizer.safetensors   the optimizer's state tensors (moments)
        parallel_plan.json      the run's ParallelPlan (mesh, placements, ZeRO stage, sp)
        trainer_state.json      step, tokens seen, optimizer groups and step count, schedule, data
                                position, RNG state, and the run's config

The trainer saves only between steps, so every part describes the same step; loading checks that
they do, and checks every file, before it changes anything. A resumed run takes its settings from
its own config (`config.resume_changes` says which may differ from the checkpoint's) and its state
from the checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

import llmkit.framework as lf
from llmkit.framework import optim
from llmkit.framework.distributed.plan import PLAN_FILE
from llmkit.framework.files import atomic_dir, recover
from llmkit.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from .trainer import Trainer

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"


class ResumeError(ValueError):
    """A checkpoint ``--resume`` cannot continue from; the message names the file and what is wrong."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _OptimizerMeta(_Strict):
    param_groups: list[dict[str, Any]]
    step: int = Field(ge=0)


class _ScheduleState(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # plus the schedule's own settings
    type: str
    last_step: int = Field(ge=0)
    base_lrs: list[float]


class _SamplerState(_Strict):
    seed: int = Field(ge=0)
    step: int = Field(ge=0)


class TrainerState(_Strict):
    """``trainer_state.json``, checked: every part at the same step."""

    step: int = Field(ge=0)
    tokens_seen: int = Field(ge=0)
    optimizer: _OptimizerMeta
    schedule: _ScheduleState
    sampler: _SamplerState
    rng: dict[str, Any]
    config: dict[str, Any] | None = None  # None in checkpoints written before it was recorded

    @model_validator(mode="after")
    def _one_step(self) -> TrainerState:
        if not self.optimizer.step == self.schedule.last_step == self.step:
            raise ValueError(
                f"its parts are at different steps (trainer {self.step}, optimizer "
                f"{self.optimizer.step}, schedule {self.schedule.last_step})"
            )
        return self


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return out_dir / CHECKPOINTS / f"step-{step:08d}"


def checkpoints(out_dir: Path) -> list[Path]:
    """The run's checkpoints, oldest first (temporary and replaced directories start with a dot)."""
    root = out_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    for parked in root.glob(".step-*.old"):  # a replacement a crash interrupted: finish it first
        recover(root / parked.name[1 : -len(".old")])
    return sorted(p for p in root.glob("step-*") if p.is_dir())


def latest(out_dir: Path) -> Path:
    found = checkpoints(out_dir)
    if not found:
        raise ResumeError(f"--resume: no checkpoint under {out_dir / CHECKPOINTS}")
    return found[-1]


def read_state(path: Path) -> TrainerState:
    """The checked ``trainer_state.json`` of checkpoint ``path``."""
    file = path / TRAINER_STATE
    try:
        raw = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise ResumeError(f"{file}: missing (an incomplete checkpoint?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResumeError(f"{file}: not valid JSON ({e})") from None
    try:
        return TrainerState.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        message = err["msg"].removeprefix("Value error, ")
        raise ResumeError(f"{file}: {where + ': ' if where else ''}{message}") from None


def save(trainer: Trainer) -> Path:
    """Write the trainer's state at ``trainer.step`` atomically; keep the newest ``keep_last``."""
    path = checkpoint_dir(trainer.out, trainer.step)
    with atomic_dir(path) as tmp:
        trainer.model.save_pretrained(tmp / "model")
        trainer.tokenizer.save_pretrained(tmp / "model")
        trainer.plan.save(tmp / PLAN_FILE)
        tensors, meta = optim.flatten_state_dict(trainer.optimizer.state_dict())
        lf.save(tensors, tmp / OPTIMIZER)
        state = {
            "step": trainer.step,
            "tokens_seen": trainer.tokens_seen,
            "optimizer": meta,
            "schedule": trainer.schedule.state_dict(),
            "sampler": trainer.sampler.state_dict(),
            "rng": lf.backend.get_rng_state(),
            "config": trainer.cfg.model_dump(mode="json"),
        }
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1))
    for old in checkpoints(trainer.out)[: -trainer.cfg.train.keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load(trainer: Trainer, path: Path, state: TrainerState) -> None:
    """Restore the state of checkpoint ``path`` into the trainer, keeping the hyperparameters of its
    config (optimizer groups and schedule settings); ResumeError names the first bad file."""
    try:
        loaded = LlamaForCausalLM.from_pretrained(path / "model")
    except ValueError as e:  # a bad config.json or weights file; the message names it
        raise ResumeError(f"cannot load the checkpoint's model: {e}") from None
    saved, own = loaded.config.to_dict(), trainer.model_config.to_dict()
    for key in own:
        if saved.get(key) != own[key]:
            raise ResumeError(
                f"{path / 'model' / 'config.json'}: {key} is {saved.get(key)!r}, "
                f"this run's model has {own[key]!r}"
            )
    opt, tensors = trainer.optimizer, lf.load(path / OPTIMIZER)
    try:
        opt_state = optim.unflatten_state_dict(tensors, state.optimizer.model_dump())
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        opt.load_state_dict(opt_state)  # checks everything before it changes anything
    except ValueError as e:
        raise ResumeError(f"{path / OPTIMIZER}: {e}") from None
    for group, h in zip(opt.param_groups, hyper, strict=True):
        group.update(h)  # this run's lr, betas, weight decay... (a resumed run may change them)
    try:
        lf.backend.set_rng_state(state.rng)
    except (KeyError, TypeError, ValueError) as e:
        raise ResumeError(f"{path / TRAINER_STATE}: rng: {e!r}") from None
    trainer.model.load_state_dict(loaded.state_dict())
    # The schedule is a closed form of the step: this run's settings, the checkpoint's step.
    trainer.schedule.load_state_dict({**trainer.schedule.state_dict(), "last_step": state.step})
    trainer.sampler.load_state_dict(state.sampler.model_dump())
    trainer.step, trainer.tokens_seen = state.step, state.tokens_seen
