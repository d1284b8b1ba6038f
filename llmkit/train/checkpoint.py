"""Run checkpoints, of every job (``llmkit train``, ``llmkit rlhf``): everything ``--resume`` needs to
continue a run exactly, on any mesh. One writer and one reader, of the loop's state (:class:`RunState`)
plus each job's extras.

    out_dir/checkpoints/step-00000600/
        model/                  config.json, tokenizer.model and the weights: model.safetensors
                                (Hugging Face layout) from one process, rank-NNNNN.safetensors
                                pieces from several (``llmkit checkpoint merge`` joins them)
        adapter/, base_model.json   instead of model/ in a LoRA run: the adapters in PEFT's format
                                (adapter_config.json, adapter_model.safetensors; the tokenizer) and
                                a pointer to the frozen base (its directory and the sha256 of its
                                files, checked on resume); ``llmkit checkpoint merge-lora`` writes the
                                merged model
        <name>.safetensors      a job's other trained layers (PPO's value head)
        optimizer.safetensors   the optimizer's state tensors (moments); optimizer/rank-NNNNN... from
                                several processes
        parallel_plan.json      llmkit train: the run's ParallelPlan (mesh, placements, ZeRO stage, sp)
        trainer_state.json      step, optimizer groups and step count, schedule, the run's config,
                                and the job's own entries (llmkit train: tokens seen, data
                                position, RNG state)
        COMPLETE                written last: a checkpoint without it does not count

Every file is fsynced before the directory takes its place (``files.atomic_dir``), so a run killed
at any moment (even with ``kill -9``) leaves its newest complete checkpoint, which ``--resume`` takes.
Data-parallel ranks that hold the same state (``llmkit rlhf``) write one copy, from rank 0.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework import nn, optim
from llmkit.framework.distributed.parallel_plan import PLAN_FILE
from llmkit.framework.distributed.shard_files import RANK_FILES, ShardReader, save_shards
from llmkit.framework.files import atomic_dir, atomic_write, install_dir, recover, sha256
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM, LlamaTokenizer, lora
from llmkit.models.llama.checkpoint import CheckpointError, check_weights, write_config
from llmkit.models.llama.checkpoint import weights as llama_weights

from .config import ConfigError
from .metrics import peak_rss_bytes

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"  # one process
OPTIMIZER_DIR = "optimizer"  # several: rank-NNNNN.safetensors pieces
COMPLETE = "COMPLETE"  # the commit marker, written last
ADAPTER = "adapter"  # a LoRA run's adapters (PEFT's files), in place of model/
BASE_POINTER = "base_model.json"  # and the frozen base they apply to


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
    """``trainer_state.json``, checked: every part at the same step (the optimizer's too, for a job
    that updates once a step: the validation context's ``one_update_per_step``)."""

    step: int = Field(ge=0)
    optimizer: _OptimizerMeta
    schedule: _ScheduleState
    config: dict[str, Any] | None = None  # None in checkpoints written before it was recorded
    # llmkit train's own entries (a job's ``state_keys``, required where it names them)
    tokens_seen: int | None = Field(None, ge=0)
    sampler: _SamplerState | None = None
    rng: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_step(self, info: ValidationInfo) -> TrainerState:
        one = (info.context or {}).get("one_update_per_step", True)
        optimizer = self.optimizer.step if one else self.step
        if not optimizer == self.schedule.last_step == self.step:
            raise ValueError(
                f"its parts are at different steps (trainer {self.step}, optimizer "
                f"{self.optimizer.step}, schedule {self.schedule.last_step})"
            )
        return self


@dataclass
class RunState:
    """What a checkpoint holds of a run, from the loop: its step, config, model (and tokenizer),
    other trained layers, optimizer and schedule, plus the job's own ``trainer_state.json`` entries;
    and how this process takes part in writing and reading it."""

    out: Path  # the run's out_dir
    step: int
    config: BaseModel  # the run's config: recorded, and compared on --resume
    model: Any  # a causal LM or reward model: save_pretrained, named_parameters, config
    tokenizer: Any
    optimizer: optim.Optimizer
    schedule: optim.LRScheduler
    layers: dict[str, nn.Layer] = field(default_factory=dict)  # saved as <name>.safetensors
    extras: dict[str, Any] = field(default_factory=dict)  # the job's trainer_state.json entries
    writer: bool = True  # this process writes the files that are not per-rank pieces (rank 0)
    plan: Any = None  # a ParallelPlan, written as parallel_plan.json
    sharded: bool = False  # several ranks, each writing (and reading) the pieces it holds
    par: Any = None  # the ranks' layout (Parallelized) that pieces are read into
    pipe: Any = None  # a pipeline (PipelineRun): its stages write and read their own pieces
    base: dict[str, Any] | None = None  # a LoRA run: its base's pointer (base_pointer), saved beside
    # the adapters instead of the whole model

    @property
    def keep_last(self) -> int:
        return self.config.train.keep_last


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


def remove_staging(out_dir: Path) -> None:
    """Remove what writes cut short by a crash left: staging directories (``.step-*.<hex>.tmp`` of
    one writer, ``.step-*.partial`` of several). Only for the run's own writer, while it writes
    nothing (a resumed run, before its first step)."""
    for p in (out_dir / CHECKPOINTS).glob(".step-*"):
        if p.name.endswith((".tmp", ".partial")):
            shutil.rmtree(p, ignore_errors=True)


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
    adapters = [c for c in checkpoints(p) if (c / ADAPTER).is_dir()]
    if adapters:
        raise ConfigError(
            f"{key}: {str(path)!r} is a LoRA run: its checkpoints hold adapters, not a model; "
            f"write the merged model with `llmkit checkpoint merge-lora {adapters[-1]} --out DIR`"
        )
    if not p.exists():
        raise ConfigError(
            f"{key}: {str(path)!r} does not exist; train the model first "
            "(llmkit train configs/tiny.yaml writes runs/tiny) or point it at a checkpoint directory"
        )
    raise ConfigError(
        f"{key}: {str(path)!r} is neither a model directory (config.json) nor a run with checkpoints"
    )


def read_state(path: Path, one_update_per_step: bool = True, required: tuple[str, ...] = ()) -> TrainerState:
    """The checked ``trainer_state.json`` of checkpoint ``path`` (``required``: the job's own
    entries it must have)."""
    file = path / TRAINER_STATE
    try:
        raw = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise ResumeError(f"{file}: missing (an incomplete checkpoint?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResumeError(f"{file}: not valid JSON ({e})") from None
    try:
        state = TrainerState.model_validate(raw, context={"one_update_per_step": one_update_per_step})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        message = err["msg"].removeprefix("Value error, ")
        raise ResumeError(f"{file}: {where + ': ' if where else ''}{message}") from None
    missing = next((k for k in required if getattr(state, k) is None), None)
    if missing is not None:
        raise ResumeError(f"{file}: {missing}: Field required")
    return state


def base_pointer(directory: Path) -> dict[str, Any]:
    """What a LoRA checkpoint records of its frozen base: the directory and the sha256 of each of
    its files (config and weights), so that a resume on another base fails instead of drifting."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors"))
    return {"path": str(directory.resolve()), "sha256": {p.name: sha256(p) for p in files}}


def _write_rest(s: RunState, tmp: Path, meta: dict[str, Any], adapters: dict | None = None) -> None:
    """What rank 0 writes once every rank's tensors are in: a LoRA run's adapters (``adapters``: their
    whole values, where the model's are laid out over ranks) and base pointer, tokenizer, plan,
    state, marker (last)."""
    if s.base is not None:  # the adapters alone, beside a pointer to the base
        (tmp / ADAPTER).mkdir()
        lora.write_adapter(s.model, tmp / ADAPTER, s.base["path"], adapters)
        (tmp / BASE_POINTER).write_text(json.dumps(s.base, indent=1) + "\n")
    s.tokenizer.save_pretrained(tmp / ("model" if s.base is None else ADAPTER))
    if s.plan is not None:
        s.plan.save(tmp / PLAN_FILE)
    state = {
        "step": s.step,
        "optimizer": meta,
        "schedule": s.schedule.state_dict(),
        **s.extras,
        "config": s.config.model_dump(mode="json"),
    }
    (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1))
    atomic_write(tmp / COMPLETE, f"step {s.step}\n")


def save(s: RunState) -> Path:
    """Write the run's state at ``s.step`` (every rank calls this); keep the newest ``keep_last``."""
    path = checkpoint_dir(s.out, s.step)
    if s.sharded:
        _save_sharded(s, path)
    elif s.writer:
        with atomic_dir(path) as tmp:
            if s.base is None:  # else the adapters (_write_rest)
                s.model.save_pretrained(tmp / "model")
            for name, layer in s.layers.items():
                lf.save({k: v.numpy() for k, v in layer.state_dict().items()}, tmp / f"{name}.safetensors")
            tensors, meta = optim.flatten_state_dict(s.optimizer.state_dict())
            lf.save(tensors, tmp / OPTIMIZER)
            _write_rest(s, tmp, meta)
    if s.writer:
        for old in checkpoints(s.out)[: -s.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def _save_sharded(s: RunState, path: Path) -> None:
    stage = path.parent / f".{path.name}.partial"
    comm = dist.get_backend()
    if s.writer and stage.exists():
        shutil.rmtree(stage)  # left by a run that crashed while writing
    comm.barrier()
    model, adapters = s.model, None
    if s.pipe is not None:  # each pipeline rank its stages' pieces, under the whole model's names
        s.pipe.save(stage / "model", stage / OPTIMIZER_DIR)
        meta = s.pipe.optimizer_meta()
    else:
        if s.base is None:
            save_shards(dict(model.named_parameters()), stage / "model")
        else:  # a LoRA run: the adapters whole (they are small), in PEFT's files as from one process
            adapters = {k: dist.unshard(t) for k, t in lora.adapter_state(model).items()}
        tensors, meta = optim.flatten_state_dict(s.optimizer.state_dict())
        save_shards(tensors, stage / OPTIMIZER_DIR)
    comm.barrier()  # every rank's pieces are on disk
    if s.writer:
        if s.base is None:
            write_config(model.config, model.model.norm.weight.dtype, stage / "model")
        _write_rest(s, stage, meta, adapters)
        install_dir(stage, path)
    comm.barrier()  # the checkpoint is in place before any rank goes on (and may prune or resume)


def load(s: RunState, path: Path, state: TrainerState) -> tuple[int, int, int]:
    """Restore the state of checkpoint ``path`` into the run's model, layers, optimizer and schedule,
    keeping the hyperparameters of its config (optimizer groups and schedule settings), each rank
    reading only the slices it holds; ResumeError names the first bad file. Returns (bytes the
    fullest rank read, bytes of the whole checkpoint, peak host memory)."""
    if s.base is not None:
        _check_base(s.base, path)
    config_json = (path / "model" if s.base is None else Path(s.base["path"])) / "config.json"
    try:
        saved = LlamaConfig.from_json_file(config_json).to_dict()
    except (OSError, ValueError) as e:
        raise ResumeError(f"cannot load the checkpoint's model: {e}") from None
    own = s.model.config.to_dict()
    for key in own:
        if key != "torch_dtype" and saved.get(key) != own[key]:
            raise ResumeError(
                f"{config_json}: {key} is {saved.get(key)!r}, this run's model has {own[key]!r}"
            )
    try:
        if s.base is None:
            weights, names = _model_weights(s.model, path / "model")
        else:
            lora.load_adapter(s.model, path / ADAPTER)  # checked whole before it sets anything
            if s.par is not None:  # the whole values just set, laid out as the plan places them
                s.par.place(list(lora.adapter_state(s.model)))
        layers = {n: _layer_weights(layer, path / f"{n}.safetensors") for n, layer in s.layers.items()}
    except (OSError, ValueError) as e:
        raise ResumeError(
            f"cannot load the checkpoint's {'model' if s.base is None else 'adapters'}: {e}"
        ) from None
    opt = s.optimizer
    try:
        moments = _optimizer_reader(path)
        if s.pipe is not None:  # every pipeline rank its stages' weights and moments, by name
            read = s.pipe.load(weights, moments, state.optimizer.step)
        else:
            tensors = {k: _read(s, moments, k) for k in moments.names()}
            opt_state = optim.unflatten_state_dict(tensors, state.optimizer.model_dump())
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.load_state_dict(opt_state)  # checks everything before it changes anything
    except (OSError, ValueError, KeyError) as e:
        where = path / (OPTIMIZER if (path / OPTIMIZER).exists() else OPTIMIZER_DIR)
        raise ResumeError(f"{where}: {e}") from None
    if s.pipe is None:
        for group, h in zip(opt.param_groups, hyper, strict=True):
            group.update(h)  # this run's lr, betas, weight decay... (a resumed run may change them)
    if state.rng is not None:
        try:
            lf.backend.set_rng_state(state.rng)
        except (KeyError, TypeError, ValueError) as e:
            raise ResumeError(f"{path / TRAINER_STATE}: rng: {e!r}") from None
    if s.base is not None:
        read = total = sum(f.stat().st_size for f in (path / ADAPTER).iterdir()) + moments.total_bytes
    else:
        total = weights.total_bytes + moments.total_bytes
    if s.base is None and s.pipe is None:
        _set_weights(s, weights, names)
        per_rank = [weights.rank_bytes.get(r, 0) + moments.rank_bytes.get(r, 0) for r in weights.rank_bytes]
        read = max(per_rank) if per_rank else weights.bytes_read + moments.bytes_read
    for name, layer in s.layers.items():
        layer.load_state_dict(layers[name])
    # The schedule is a closed form of the step: this run's settings, the checkpoint's step.
    s.schedule.load_state_dict({**s.schedule.state_dict(), "last_step": state.step})
    return read, total, peak_rss_bytes()


def _check_base(base: dict[str, Any], path: Path) -> None:
    """The run's frozen base is the one the checkpoint's adapters were trained on."""
    file = path / BASE_POINTER
    try:
        saved = json.loads(file.read_text())
    except FileNotFoundError:
        what = "a full model (model/)" if (path / "model").is_dir() else "no base pointer"
        raise ResumeError(
            f"{file}: missing; the checkpoint holds {what}, this run trains adapters (lora)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResumeError(f"{file}: not valid JSON ({e})") from None
    if saved.get("sha256") != base["sha256"]:
        raise ResumeError(
            f"{file}: the adapters were trained on the base at {saved.get('path')!r}, whose files differ "
            f"from this run's base ({base['path']!r}); resume on the same base"
        )


def _model_weights(model: Any, model_dir: Path) -> tuple[ShardReader, list[str]]:
    """The weights of a model directory (either layout), checked against ``model``."""
    weights = llama_weights(model_dir)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    return weights, check_weights(weights, shapes, model_dir, model.config.tie_word_embeddings)


def _layer_weights(layer: nn.Layer, file: Path) -> dict[str, Any]:
    """A trained layer's tensors from its file, checked against the layer's parameters."""
    tensors = lf.load(file)
    want = {n: p.shape for n, p in layer.named_parameters()}
    got = {n: tuple(v.shape) for n, v in tensors.items()}
    if got != want:
        raise CheckpointError(f"{file}: tensors {got}, this run's layer has {want}")
    return tensors


def _set_weights(s: RunState, weights: ShardReader, names: list[str]) -> None:
    params = dict(s.model.named_parameters())
    for name in names:
        params[name].set_value(_read(s, weights, name, params[name]))


def load_weights(s: RunState, model_dir: Path) -> None:
    """Set the model's weights from a Hugging Face directory, each rank reading only its slices."""
    _set_weights(s, *_model_weights(s.model, model_dir))


def _optimizer_reader(path: Path) -> ShardReader:
    single = path / OPTIMIZER
    files = [single] if single.exists() else sorted((path / OPTIMIZER_DIR).glob(RANK_FILES))
    if not files:
        raise FileNotFoundError(f"no {OPTIMIZER} or {OPTIMIZER_DIR}/{RANK_FILES}")
    return ShardReader(files)


def _read(s: RunState, reader: ShardReader, name: str, like: lf.Tensor | None = None) -> lf.Tensor:
    """Tensor ``name`` of the checkpoint as this run holds it: whole in one process, else each hosted
    rank's region of the placement the plan gives it (a parameter's, or its optimizer state's)."""
    par = s.par
    if par is None:
        value = reader.read(name)
        return lf.Tensor(value if like is None else value.astype(like.dtype, copy=False))
    if like is not None:
        placements = par.placements(name)
    else:  # state.<j>.<key>: the j-th optimizer parameter's state
        j = int(name.split(".")[1])
        placements = par.placements(par.names[id(s.optimizer.params[j])], "state")
    value = lf.Tensor(reader.read_placed(name, par.mesh, placements))
    return value if like is None else value.astype(like.dtype)


def merge(path: Path, out: Path) -> Path:
    """Write the model of checkpoint ``path`` (either layout) as a plain Hugging Face directory."""
    model = LlamaForCausalLM.from_pretrained(path / "model")
    model.save_pretrained(out)
    LlamaTokenizer.from_pretrained(path / "model").save_pretrained(out)
    return out


def merge_lora(path: Path, out: Path, base: Path | None = None) -> Path:
    """Write base + adapters as one complete model directory (``lora.merge_lora``: W + (B @ A) *
    alpha / r; a quantized layer with an adapter becomes a float one, the others stay quantized).
    ``path``: a LoRA checkpoint (adapter/ and base_model.json) or a PEFT adapter directory;
    ``base``: the base model directory (default: the checkpoint's pointer, whose hashes must still
    hold, or the adapter's ``base_model_name_or_path``)."""
    adapter = path / ADAPTER if (path / ADAPTER).is_dir() else path
    if not (adapter / lora.CONFIG_FILE).is_file():
        raise ResumeError(
            f"{path}: neither a LoRA checkpoint ({ADAPTER}/) nor an adapter ({lora.CONFIG_FILE})"
        )
    if base is None and (path / BASE_POINTER).is_file():
        pointer = json.loads((path / BASE_POINTER).read_text())
        base = Path(pointer["path"])
        if not (base / "config.json").is_file():
            raise ResumeError(f"{path / BASE_POINTER}: the base model {str(base)!r} is gone; pass --base DIR")
        _check_base(base_pointer(base), path)
    if base is None:
        named = json.loads((adapter / lora.CONFIG_FILE).read_text()).get("base_model_name_or_path")
        if not named or not (Path(named) / "config.json").is_file():
            raise ResumeError(
                f"{adapter / lora.CONFIG_FILE}: base_model_name_or_path {named!r} is not a model directory; "
                "pass --base DIR"
            )
        base = Path(named)
    model = LlamaForCausalLM.from_pretrained(base)
    lora.load_adapter(model, adapter)
    lora.merge_lora(model)
    if not any(isinstance(m, nn.QuantizedLinear) for m in model.sublayers()):
        model.config.extra.pop("quantization_config", None)
    # else: the layers without adapters stay quantized, the merged ones are float (W dequantized)
    source = adapter if (adapter / "tokenizer_config.json").is_file() else base
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        LlamaTokenizer.from_pretrained(source).save_pretrained(tmp)
    return out
