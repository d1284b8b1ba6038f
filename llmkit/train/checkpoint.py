"""Training checkpoints: everything ``--resume`` needs to continue a run exactly, on any mesh.

    out_dir/checkpoints/step-00000600/
        model/                  config.json, tokenizer.model and the weights: model.safetensors
                                (Hugging Face layout) from one process, rank-NNNNN.safetensors
                                pieces from several (``llmkit checkpoint merge`` joins them)
        optimizer.safetensors   the optimizer's state tensors (moments); optimizer/rank-NNNNN... from
                                several processes
        parallel_plan.json      the run's ParallelPlan (mesh, placements, ZeRO stage, sp)
        trainer_state.json      step, tokens seen, optimizer groups and step count, schedule, data
                                position, RNG state, and the run's config
        COMPLETE                written last: a checkpoint without it does not count

With several processes each rank writes the pieces it owns in parallel into a staging directory
(``.step-00000600.partial``); when every rank has finished (a barrier), rank 0 writes the rest, the
commit marker last, and renames the directory into place. A crash at any point leaves no
directory that ``--resume`` would take. Loading reads, for each rank, only the slices its
placements need, from either layout, so a run resumes on another mesh (tp=2 -> dp=2 -> one
process) with the losses it would have had.

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
import llmkit.framework.distributed as dist
from llmkit.framework import optim
from llmkit.framework.distributed.parallel_plan import PLAN_FILE
from llmkit.framework.distributed.shard_files import RANK_FILES, ShardReader, save_shards
from llmkit.framework.files import atomic_dir, atomic_write, install_dir, recover
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
from llmkit.models.llama.checkpoint import check_weights, write_config
from llmkit.models.llama.checkpoint import weights as llama_weights

from .config import ConfigError
from .metrics import peak_rss_bytes

if TYPE_CHECKING:
    from .trainer import Trainer

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"  # one process
OPTIMIZER_DIR = "optimizer"  # several: rank-NNNNN.safetensors pieces
COMPLETE = "COMPLETE"  # the commit marker, written last


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
    """The run's complete checkpoints, oldest first (staging and replaced directories start with a
    dot; a directory without the commit marker was cut short)."""
    root = out_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    for parked in root.glob(".step-*.old"):  # a replacement a crash interrupted: finish it first
        recover(root / parked.name[1 : -len(".old")])
    found = sorted(p for p in root.glob("step-*") if p.is_dir())
    return [p for p in found if (p / COMPLETE).is_file()]


def latest(out_dir: Path) -> Path:
    found = checkpoints(out_dir)
    if not found:
        cut = sorted(p.name for p in (out_dir / CHECKPOINTS).glob("*step-*") if not (p / COMPLETE).is_file())
        hint = f" ({', '.join(cut)}: incomplete, no {COMPLETE} marker)" if cut else ""
        raise ResumeError(f"--resume: no checkpoint under {out_dir / CHECKPOINTS}{hint}")
    return found[-1]


def model_dir(path: str | Path, key: str = "model.init_from") -> Path:
    """A Hugging Face model directory, or a run directory (``llmkit train``'s or ``llmkit rlhf``'s
    ``out_dir``) standing for its newest checkpoint's ``model/``."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    found = [c / "model" for c in checkpoints(p) if (c / "model" / "config.json").is_file()]
    if found:
        return found[-1]
    if not p.exists():
        raise ConfigError(
            f"{key}: {str(path)!r} does not exist; train the model first "
            "(llmkit train configs/tiny.yaml writes runs/tiny) or point it at a checkpoint directory"
        )
    raise ConfigError(
        f"{key}: {str(path)!r} is neither a model directory (config.json) nor a run with checkpoints"
    )


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


def _optimizer_tensors(trainer: Trainer) -> tuple[dict[str, lf.Tensor], dict[str, Any]]:
    return optim.flatten_state_dict(trainer.optimizer.state_dict())


def _write_rest(trainer: Trainer, tmp: Path, meta: dict[str, Any]) -> None:
    """What rank 0 writes once every rank's tensors are in: tokenizer, plan, state, marker (last)."""
    trainer.tokenizer.save_pretrained(tmp / "model")
    trainer.plan.save(tmp / PLAN_FILE)
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
    atomic_write(tmp / COMPLETE, f"step {trainer.step}\n")


def save(trainer: Trainer) -> Path:
    """Write the trainer's state at ``trainer.step`` (every rank calls this); keep the newest
    ``keep_last``."""
    path = checkpoint_dir(trainer.out, trainer.step)
    if trainer.backend is None:
        with atomic_dir(path) as tmp:
            trainer.model.save_pretrained(tmp / "model")
            tensors, meta = _optimizer_tensors(trainer)
            lf.save(tensors, tmp / OPTIMIZER)
            _write_rest(trainer, tmp, meta)
    else:
        _save_sharded(trainer, path)
    if trainer.is_rank0:
        for old in checkpoints(trainer.out)[: -trainer.cfg.train.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def _save_sharded(trainer: Trainer, path: Path) -> None:
    stage = path.parent / f".{path.name}.partial"
    comm = dist.get_backend()
    if trainer.is_rank0 and stage.exists():
        shutil.rmtree(stage)  # left by a run that crashed while writing
    comm.barrier()
    model = trainer.model
    if trainer.pipe is not None:  # each pipeline rank its stages' pieces, under the whole model's names
        trainer.pipe.save(stage / "model", stage / OPTIMIZER_DIR)
        meta = trainer.pipe.optimizer_meta()
    else:
        save_shards(dict(model.named_parameters()), stage / "model")
        tensors, meta = _optimizer_tensors(trainer)
        save_shards(tensors, stage / OPTIMIZER_DIR)
    comm.barrier()  # every rank's pieces are on disk
    if trainer.is_rank0:
        write_config(model.config, model.model.norm.weight.dtype, stage / "model")
        _write_rest(trainer, stage, meta)
        install_dir(stage, path)
    comm.barrier()  # the checkpoint is in place before any rank goes on (and may prune or resume)


def load(trainer: Trainer, path: Path, state: TrainerState) -> None:
    """Restore the state of checkpoint ``path`` into the trainer, keeping the hyperparameters of its
    config (optimizer groups and schedule settings), each rank reading only the slices it holds;
    ResumeError names the first bad file."""
    config_json = path / "model" / "config.json"
    try:
        saved = LlamaConfig.from_json_file(config_json).to_dict()
    except (OSError, ValueError) as e:
        raise ResumeError(f"cannot load the checkpoint's model: {e}") from None
    own = trainer.model_config.to_dict()
    for key in own:
        if key != "torch_dtype" and saved.get(key) != own[key]:
            raise ResumeError(
                f"{config_json}: {key} is {saved.get(key)!r}, this run's model has {own[key]!r}"
            )
    try:
        weights, names = _model_weights(trainer, path / "model")
    except (OSError, ValueError) as e:
        raise ResumeError(f"cannot load the checkpoint's model: {e}") from None
    opt = trainer.optimizer
    try:
        moments = _optimizer_reader(path)
        if trainer.pipe is not None:  # every pipeline rank its stages' weights and moments, by name
            read = trainer.pipe.load(weights, moments, state.optimizer.step)
        else:
            tensors = {k: _read(trainer, moments, k) for k in moments.names()}
            opt_state = optim.unflatten_state_dict(tensors, state.optimizer.model_dump())
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.load_state_dict(opt_state)  # checks everything before it changes anything
    except (OSError, ValueError, KeyError) as e:
        where = path / (OPTIMIZER if (path / OPTIMIZER).exists() else OPTIMIZER_DIR)
        raise ResumeError(f"{where}: {e}") from None
    if trainer.pipe is None:
        for group, h in zip(opt.param_groups, hyper, strict=True):
            group.update(h)  # this run's lr, betas, weight decay... (a resumed run may change them)
    try:
        lf.backend.set_rng_state(state.rng)
    except (KeyError, TypeError, ValueError) as e:
        raise ResumeError(f"{path / TRAINER_STATE}: rng: {e!r}") from None
    if trainer.pipe is None:
        _set_weights(trainer, weights, names)
        per_rank = [weights.rank_bytes.get(r, 0) + moments.rank_bytes.get(r, 0) for r in weights.rank_bytes]
        read = max(per_rank) if per_rank else weights.bytes_read + moments.bytes_read
    trainer.load_report = (read, weights.total_bytes + moments.total_bytes, peak_rss_bytes())
    # The schedule is a closed form of the step: this run's settings, the checkpoint's step.
    trainer.schedule.load_state_dict({**trainer.schedule.state_dict(), "last_step": state.step})
    trainer.sampler.load_state_dict(state.sampler.model_dump())
    trainer.step, trainer.tokens_seen = state.step, state.tokens_seen


def _model_weights(trainer: Trainer, model_dir: Path) -> tuple[ShardReader, list[str]]:
    """The weights of a model directory (either layout), checked against the trainer's model."""
    weights = llama_weights(model_dir)
    shapes = {n: p.shape for n, p in trainer.model.named_parameters()}
    return weights, check_weights(weights, shapes, model_dir, trainer.model_config.tie_word_embeddings)


def _set_weights(trainer: Trainer, weights: ShardReader, names: list[str]) -> None:
    params = dict(trainer.model.named_parameters())
    for name in names:
        params[name].set_value(_read(trainer, weights, name, params[name]))


def load_weights(trainer: Trainer, model_dir: Path) -> None:
    """Set the model's weights from a Hugging Face directory, each rank reading only its slices."""
    _set_weights(trainer, *_model_weights(trainer, model_dir))


def _optimizer_reader(path: Path) -> ShardReader:
    single = path / OPTIMIZER
    files = [single] if single.exists() else sorted((path / OPTIMIZER_DIR).glob(RANK_FILES))
    if not files:
        raise FileNotFoundError(f"no {OPTIMIZER} or {OPTIMIZER_DIR}/{RANK_FILES}")
    return ShardReader(files)


def _read(trainer: Trainer, reader: ShardReader, name: str, like: lf.Tensor | None = None) -> lf.Tensor:
    """Tensor ``name`` of the checkpoint as this run holds it: whole in one process, else each hosted
    rank's region of the placement the plan gives it (a parameter's, or its optimizer state's)."""
    par = trainer.par
    if par is None:
        value = reader.read(name)
        return lf.Tensor(value if like is None else value.astype(like.dtype, copy=False))
    if like is not None:
        placements = par.placements(name)
    else:  # state.<j>.<key>: the j-th optimizer parameter's state
        j = int(name.split(".")[1])
        placements = par.placements(par.names[id(trainer.optimizer.params[j])], "state")
    value = lf.Tensor(reader.read_placed(name, par.mesh, placements))
    return value if like is None else value.astype(like.dtype)


def merge(path: Path, out: Path) -> Path:
    """Write the model of checkpoint ``path`` (either layout) as a plain Hugging Face directory."""
    model = LlamaForCausalLM.from_pretrained(path / "model")
    model.save_pretrained(out)
    LlamaTokenizer.from_pretrained(path / "model").save_pretrained(out)
    return out
