"""The training-run config: one typed schema, read from YAML plus `section.key=value` overrides.

    cfg = load_config("configs/tiny.yaml", ["train.steps=100", "optim.lr=1e-3"])

Every section rejects unknown keys and wrong types; a bad config raises `ConfigError` with one line
naming the dotted key, the value and what was expected:

    config error: train.steps: expected an integer, got 'ten'
    config error: unknown key optim.learning_rate (did you mean optim.lr?)

Values (in files and overrides) are YAML, read as YAML 1.2 reads numbers, so `1e-3` is a float
(PyYAML's YAML 1.1 would read it as a string).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from llmkit.framework.distributed.parallel_plan import ParallelPlan, PipelinePlan, PlanError
from llmkit.framework.distributed.pipeline import PipelineError, parse_stages
from llmkit.framework.distributed.pipeline_schedule import SCHEDULES, ScheduleError, make_schedule
from llmkit.framework.files import atomic_write
from llmkit.models.llama.config import PRESETS, LlamaConfig
from llmkit.models.llama.lora import ALL_LINEAR, LoraConfig, LoraError, apply_lora
from llmkit.models.llama.tokenizer import KINDS as TOKENIZER_KINDS


class ConfigError(ValueError):
    """A bad run config; the message is one line starting with "config error:"."""

    def __init__(self, message: str) -> None:
        super().__init__(f"config error: {message}")


def _moved_key(raw: Any, key: str, message: str) -> Any:
    """A section's raw input, refused with ``message`` when it still holds ``key`` (a key that moved
    or was renamed: old configs get one line naming the new place)."""
    if isinstance(raw, dict) and key in raw:
        raise ValueError(message)
    return raw


class Section(BaseModel):
    """The base of every config section (other jobs' schemas build on it)."""

    # strict: no silent coercions (true -> 1, "10" -> 10); YAML already gives ints, floats and bools.
    model_config = ConfigDict(extra="forbid", strict=True)


class _ModelSectionBase(Section):
    preset: str | None = None  # a name in llmkit.models.llama.config.PRESETS
    init_from: str | None = None  # a Hugging Face checkpoint directory (config.json + weights)

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str | None) -> str | None:
        if name is not None and name not in PRESETS:
            close = _suggest(name, list(PRESETS))
            hint = f"did you mean {close!r}? " if close else ""
            raise ValueError(f"unknown preset {name!r} ({hint}known: {', '.join(PRESETS)})")
        return name

    @model_validator(mode="after")
    def _one_source(self) -> _ModelSectionBase:
        if (self.preset is None) == (self.init_from is None):
            raise ValueError(
                "set exactly one of model.preset and model.init_from "
                "(to start from a checkpoint, also set model.preset=null)"
            )
        return self

    @model_serializer(mode="wrap")
    def _only_set_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Unset overrides are None placeholders, not values: leave them out so dumps load back.
        data = handler(self)
        return {k: v for k, v in data.items() if k in ("preset", "init_from") or k in self.model_fields_set}

    def overrides(self) -> dict[str, Any]:
        """The LlamaConfig fields this section sets explicitly (an explicit null counts)."""
        fields = type(self).model_fields  # in declaration order, for stable output
        return {k: getattr(self, k) for k in fields if k in self.model_fields_set - {"preset", "init_from"}}


# `model` takes any LlamaConfig field as an override; the fields are generated from the dataclass
# so that the two never drift apart.
_LLAMA_HINTS = typing.get_type_hints(LlamaConfig)
ModelSection = create_model(
    "ModelSection",
    __base__=_ModelSectionBase,
    __doc__="The model: a preset or a checkpoint directory, plus overrides of any LlamaConfig field.",
    **{f.name: (_LLAMA_HINTS[f.name], None) for f in dataclasses.fields(LlamaConfig) if f.name != "extra"},
)


class TokenizerSection(Section):
    path: str = "builtin"  # "builtin" (trained on the built-in corpus) or an HF tokenizer directory
    vocab_size: int = Field(4096, gt=259)  # builtin only: 3 specials + 256 bytes + merges
    kind: Literal[tuple(TOKENIZER_KINDS)] = "sentencepiece"  # builtin only: models/llama/tokenizer.py

    @model_validator(mode="after")
    def _vocab_only_for_builtin(self) -> TokenizerSection:
        for key in ("vocab_size", "kind"):
            if self.path != "builtin" and key in self.model_fields_set:
                raise ValueError(f"tokenizer.{key} only applies to path: builtin, not {self.path!r}")
        return self


class DataSection(Section):
    sources: list[str] = ["builtin"]  # "builtin", files or globs; .jsonl files use their "text" field
    val_fraction: float = Field(0.05, ge=0, lt=1)  # the last part of the packed stream (see data.py)
    cache_dir: str | None = None  # token cache; null = $LLMKIT_CACHE_DIR or ~/.cache/llmkit

    @field_validator("sources", mode="before")
    @classmethod
    def _one_source_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class OptimSection(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(3e-4, gt=0)  # peak learning rate (after warmup)
    betas: tuple[float, float] = Field((0.9, 0.95), strict=False)  # adamw; strict=False: YAML lists
    eps: float = Field(1e-8, gt=0)  # adamw
    weight_decay: float = Field(0.1, ge=0)  # decoupled (AdamW-style)
    grad_clip: float | None = Field(1.0, gt=0)  # max global gradient norm; null = no clipping
    momentum: float = Field(0.9, ge=0, lt=1)  # sgd

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
        return betas


class ScheduleSection(Section):
    name: Literal["constant", "cosine", "linear"] = "cosine"  # decay after warmup
    warmup_steps: int = Field(0, ge=0)  # linear warmup from 0 to optim.lr
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine/linear end at min_lr_ratio * optim.lr


class TrainSection(Section):
    steps: int = Field(1000, gt=0)  # optimizer steps
    batch_size: int = Field(8, gt=0)  # sequences per micro-batch
    grad_accum: int = Field(1, gt=0)  # micro-batches per optimizer step
    seq_len: int = Field(256, gt=0)  # tokens per sequence
    eval_every: int = Field(100, ge=0)  # steps between val-loss evaluations; 0 = never
    eval_steps: int = Field(10, gt=0)  # val batches per evaluation
    log_every: int = Field(10, gt=0)  # steps between log lines
    save_every: int = Field(0, ge=0)  # steps between checkpoints; 0 = only at the end
    keep_last: int = Field(2, gt=0)  # checkpoints kept on disk, newest first
    seed: int = Field(0, ge=0)  # init and data order
    mode: Literal["eager", "static"] = "eager"  # static: the whole step as one compiled program
    # fusion compiler of static programs; null (default): cinn wherever a C compiler exists
    compiler: Literal["cinn", "none"] | None = None
    device: Literal["cpu", "gpu"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype

    @model_validator(mode="before")
    @classmethod
    def _recompute_moved(cls, raw: Any) -> Any:
        return _moved_key(
            raw,
            "recompute",
            "train.recompute moved to parallel.recompute (none | attention | full, with "
            "parallel.recompute_every: k); train.recompute: true is parallel.recompute: full",
        )

    @model_validator(mode="after")
    def _cinn_needs_static(self) -> TrainSection:
        if self.compiler == "cinn" and self.mode != "static":
            raise ValueError("train.compiler=cinn compiles static programs; set train.mode=static")
        return self


class ParallelSection(Section):
    """How the run spreads over ranks: pp x dp x tp processes (``llmkit train --nproc N`` or
    ``mpiexec -n N``; in one process the whole mesh is simulated), laid out by a ParallelPlan."""

    dp: int = Field(1, gt=0)  # data parallel: each rank takes batch_size / dp rows of every batch
    tp: int = Field(1, gt=0)  # tensor parallel: the plan's sharded weights are split tp ways
    sp: bool = False  # sequence parallel: the residual stream between tp regions sharded on the sequence
    zero: int = Field(0, ge=0, le=3)  # ZeRO over dp: 1 optimizer state, 2 + gradients, 3 + parameters
    plan: str | dict[str, Any] = "llama"  # built-in plan, a YAML file, or {params: {...}, outputs: {...}}
    pp: int = Field(1, gt=0)  # pipeline parallel: consecutive layers cut into pp stages, one per pp rank
    micro_batches: int = Field(1, gt=0)  # pipeline: each batch cut into this many, run by the schedule
    schedule: Literal[tuple(SCHEDULES)] = "1f1b"  # type: ignore[valid-type]  # the pipeline's job order
    virtual_stages: int = Field(1, gt=0)  # interleaved: stages per pp rank (pp x virtual_stages in all)
    pp_stages: list[str | int] | None = None  # layer ranges, one per stage ("0-11"); null: balanced by cost
    recompute: Literal["none", "attention", "full"] = "none"  # what a layer recomputes in the backward
    recompute_every: int = Field(1, gt=0)  # the policy applies to layers 0, k, 2k, ...
    auto: bool = False  # `parallel: auto`: the planner picks the rest (llmkit train resolves it)

    @model_validator(mode="before")
    @classmethod
    def _auto_alone(cls, raw: Any) -> Any:
        if raw == "auto":
            return {"auto": True}
        if isinstance(raw, dict) and raw.get("auto") and len(raw) > 1:
            others = ", ".join(sorted(k for k in raw if k != "auto"))
            raise ValueError(f"parallel: auto picks every parallel key itself; drop {others}")
        return raw

    @model_validator(mode="after")
    def _plan_applies(self) -> ParallelSection:
        if self.recompute == "none" and self.recompute_every != 1:
            raise ValueError(
                f"parallel.recompute_every ({self.recompute_every}) applies to a recompute policy: "
                "set parallel.recompute (attention or full) too"
            )
        self._check_pipeline()
        self.build()
        return self

    def _check_pipeline(self) -> None:
        """One error per bad pipeline setting, naming its key."""
        keys = ("micro_batches", "schedule", "virtual_stages", "pp_stages")
        if self.pp == 1:
            defaults = type(self).model_fields
            for key in keys:
                if key in self.model_fields_set and getattr(self, key) != defaults[key].default:
                    raise ValueError(f"parallel.{key} applies to pipelines: set parallel.pp > 1 too")
            return
        v, m, pp = self.virtual_stages, self.micro_batches, self.pp
        if v > 1 and self.schedule != "interleaved":
            raise ValueError(
                f"parallel.virtual_stages ({v}) needs parallel.schedule=interleaved, not {self.schedule!r}"
            )
        if self.schedule == "interleaved" and v == 1:
            raise ValueError(
                "parallel.virtual_stages: the interleaved schedule needs 2 or more stages per rank"
            )
        if self.schedule == "interleaved" and m % pp:
            raise ValueError(
                f"parallel.micro_batches ({m}) must be a multiple of parallel.pp ({pp}) under the "
                "interleaved schedule"
            )
        if self.pp_stages is not None and len(self.pp_stages) != pp * v:
            raise ValueError(
                f"parallel.pp_stages: {len(self.pp_stages)} layer ranges for {pp * v} stages "
                f"(parallel.pp x parallel.virtual_stages)"
            )
        try:
            make_schedule(self.schedule, pp, m, v)
        except ScheduleError as e:
            raise ValueError(f"parallel.schedule: {e}") from None

    def pipeline(self) -> PipelinePlan | None:
        if self.pp == 1:
            return None
        stages = None if self.pp_stages is None else tuple(map(str, self.pp_stages))
        return PipelinePlan(self.pp, self.schedule, self.micro_batches, self.virtual_stages, stages)

    def build(self) -> ParallelPlan:
        """The ParallelPlan of these settings; ValueError names the key at fault."""
        try:
            keys = self.model_dump(include={"dp", "tp", "sp", "zero", "recompute", "recompute_every"})
            return ParallelPlan.make(self.plan, pipeline=self.pipeline(), **keys)
        except PlanError as e:
            key = {"zero": "zero", "sp": "sp", "mesh": "dp"}.get(e.key, "plan")
            raise ValueError(
                f"parallel.{key}: {e}" if key == "plan" else f"parallel.{key}: {e.message}"
            ) from None


class LoraSection(Section):
    """Low-rank adapters on the frozen model (models/llama/lora.py): only they train, and
    checkpoints hold them in PEFT's format. ``model.init_from`` may be a quantized model (QLoRA)."""

    r: int = Field(8, gt=0)  # rank of each update B @ A
    alpha: float = Field(16.0, gt=0)  # the update is scaled by alpha / r
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapters' input
    targets: list[str] | Literal["all-linear"] = ["q_proj", "v_proj"]  # HF module names (PEFT's default)
    init: Literal["kaiming", "gaussian"] = "kaiming"  # kaiming: PEFT's default, B = 0 (step 0 = base)

    @field_validator("targets", mode="before")
    @classmethod
    def _one_target_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) and value != ALL_LINEAR else value

    def build(self) -> LoraConfig:
        targets = (ALL_LINEAR,) if self.targets == ALL_LINEAR else tuple(self.targets)
        return LoraConfig(self.r, self.alpha, self.dropout, targets, self.init)


def apply_lora_section(model: Any, section: LoraSection, seed: int) -> list[str]:
    """Freeze ``model`` and add the section's adapters; ConfigError names the ``lora.*`` key at
    fault (an unknown target with a did-you-mean over the model's module names, a base layer the
    backward cannot run through)."""
    try:
        return apply_lora(model, section.build(), seed)
    except LoraError as e:
        raise ConfigError(f"lora.{e.key}: {e}") from None


def check_warmup(schedule: ScheduleSection, steps: int) -> None:
    """The warm-up fits in the run (``train.steps``); the error says which key to set."""
    if schedule.warmup_steps > steps:
        raise ValueError(
            f"lr_schedule.warmup_steps ({schedule.warmup_steps}) exceeds train.steps ({steps}): "
            f"set lr_schedule.warmup_steps={steps} or fewer for a run of {steps} steps"
        )


class RunConfig(Section):
    """The root of a job's config (training, RLHF, the reward model): what every root refuses."""

    @model_validator(mode="before")
    @classmethod
    def _lr_schedule_renamed(cls, raw: Any) -> Any:
        return _moved_key(
            raw,
            "schedule",
            "schedule was renamed lr_schedule (the learning-rate schedule; "
            "parallel.schedule is the pipeline's)",
        )


class TrainConfig(RunConfig):
    """A whole training run."""

    model: ModelSection  # type: ignore[valid-type]  (a class generated above)
    tokenizer: TokenizerSection = TokenizerSection()
    data: DataSection = DataSection()
    optim: OptimSection = OptimSection()
    lr_schedule: ScheduleSection = ScheduleSection()
    train: TrainSection = TrainSection()
    parallel: ParallelSection = ParallelSection()
    lora: LoraSection | None = None  # low-rank adapters; null: full fine-tuning
    out_dir: str  # checkpoints, logs and the resolved config go here

    @model_validator(mode="after")
    def _warmup_within_run(self) -> TrainConfig:
        check_warmup(self.lr_schedule, self.train.steps)
        dp, m, b = self.parallel.dp, self.parallel.micro_batches, self.train.batch_size
        if b % m:
            raise ValueError(
                f"train.batch_size ({b}) must be a multiple of parallel.micro_batches ({m}): "
                "the pipeline cuts every batch into equal micro-batches"
            )
        if (b // m) % dp:
            per = f"a micro-batch's {b // m} rows" if m > 1 else f"train.batch_size ({b})"
            raise ValueError(
                f"{per} must be a multiple of parallel.dp ({dp}): "
                "each data-parallel rank takes the same number of rows of every batch"
            )
        if self.parallel.pp > 1 and self.train.grad_accum > 1:
            raise ValueError(
                "train.grad_accum > 1 with a pipeline: set parallel.micro_batches instead (the pipeline "
                "accumulates the micro-batches' gradients)"
            )
        return self


def check_world(par: ParallelSection, n: int, said: str) -> None:
    """ConfigError unless ``n`` ranks make the mesh; ``said`` tells where ``n`` came from
    (``"--nproc is {n}"``)."""
    dims = [d for d in ("pp", "dp", "tp") if d != "pp" or par.pp > 1]
    world = par.pp * par.dp * par.tp
    if n % par.pp:
        raise ConfigError(
            f"parallel.pp ({par.pp}) does not divide the ranks ({said.format(n=n)}): every pipeline "
            "stage runs on as many ranks"
        )
    if n != world:
        text = " x ".join(f"parallel.{d} ({getattr(par, d)})" for d in dims)
        raise ConfigError(f"{text} = {world} ranks, but {said.format(n=n)}; make them equal")


# ---- reading and writing ------------------------------------------------------------------------

C = TypeVar("C", bound=BaseModel)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads YAML 1.2 floats: `1e-3` and `1E5` are numbers, not strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_config(
    path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = (), schema: type[C] | None = None
) -> C:
    """Read a YAML run config and apply `section.key=value` overrides (values are YAML); validate it
    against ``schema`` (a config class built from the sections here; default TrainConfig)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        where = f"byte {e.start}: {e.reason}"
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({where})") from None
    try:
        raw = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        where = ""
        if getattr(e, "problem_mark", None) is not None:
            where = f" at line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    for override in overrides:
        _apply_override(raw, override)
    return parse_config(raw, schema)


def parse_config(raw: dict[str, Any], schema: type[C] | None = None) -> C:
    """Validate a config dict against ``schema`` (default TrainConfig); raise ConfigError with the
    first problem."""
    schema = schema or TrainConfig
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_describe(e.errors()[0], schema)) from None


def dump_config(cfg: BaseModel, path: str | os.PathLike[str]) -> None:
    """Write the resolved config as YAML, atomically; `load_config` reads it back equal."""
    atomic_write(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def resolve_model_config(cfg: TrainConfig, tokenizer_vocab_size: int) -> LlamaConfig:
    """The LlamaConfig of the run: preset (or checkpoint config.json) plus model.* overrides.

    A preset takes the tokenizer's vocab_size unless model.vocab_size is set; the embedding must
    have a row for every token id either way.
    """
    overrides = cfg.model.overrides()
    try:
        if cfg.model.init_from is not None:
            config_json = Path(cfg.model.init_from) / "config.json"
            try:
                hf = json.loads(config_json.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"model.init_from: cannot read {config_json}: {e}") from None
            llama = LlamaConfig.from_dict({**hf, **overrides})
        else:
            overrides = {"vocab_size": tokenizer_vocab_size, **overrides}
            llama = LlamaConfig.from_preset(cfg.model.preset, **overrides)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"model: {e}") from None
    if llama.vocab_size < tokenizer_vocab_size:
        raise ConfigError(
            f"model.vocab_size ({llama.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab_size})"
        )
    return llama


def validate_against_model(cfg: TrainConfig, llama: LlamaConfig) -> None:
    """Checks that need the resolved model: the sequence length fits its position range, the
    pipeline's stages cover its layers."""
    if cfg.train.seq_len > llama.max_position_embeddings:
        raise ConfigError(
            f"train.seq_len ({cfg.train.seq_len}) exceeds model.max_position_embeddings "
            f"({llama.max_position_embeddings})"
        )
    pipe, layers = cfg.parallel.pipeline(), llama.num_hidden_layers
    if pipe is None:
        return
    if pipe.stages is not None:
        try:
            parse_stages(pipe.stages, layers, pipe.n_stages)
        except PipelineError as e:
            raise ConfigError(f"parallel.{e}") from None
    elif layers < pipe.n_stages:
        raise ConfigError(
            f"parallel.pp: {pipe.n_stages} pipeline stages need at least as many layers; "
            f"the model has {layers} (model.num_hidden_layers)"
        )


# What a resumed run cannot change, and why: a whole section or one dotted key. Everything else a
# resumed run's config changes applies from the checkpoint's step on (see docs/train.md).
FIXED_ON_RESUME: dict[str, str] = {
    "model": "the checkpoint's weights are that model",
    "tokenizer": "the checkpoint's embeddings are indexed by that tokenizer's pieces",
    "optim.name": "the checkpoint holds that optimizer's state",
    "lora": "the checkpoint's adapters and optimizer state have those shapes",
    "train.seed": "it chose the initial weights and the batches of the steps already taken",
}


def resume_changes(
    saved: dict[str, Any], cfg: BaseModel, fixed: dict[str, str] = FIXED_ON_RESUME
) -> list[tuple[str, Any, Any]]:
    """The (dotted key, saved value, new value) of every setting `cfg` changes from the config a
    checkpoint was written with (`saved`, as `model_dump(mode="json")` gave it).

    Raises ConfigError naming the first key that cannot change on resume (``fixed``: key or section
    -> why; FIXED_ON_RESUME for training runs).
    """
    old, new = _flatten(saved), _flatten(cfg.model_dump(mode="json"))
    changes = [
        (k, old.get(k, "unset"), new.get(k, "unset"))
        for k in dict.fromkeys([*old, *new])
        if old.get(k) != new.get(k)
    ]
    for key, before, after in changes:
        for name, why in fixed.items():
            if key == name or key.startswith(name + "."):
                raise ConfigError(
                    f"{key} cannot change on --resume (checkpoint: {before}, now: {after}): {why}; "
                    "train in a new out_dir instead"
                )
    return changes


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1}} -> {"optim.lr": 1}; lists stay values."""
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[prefix + k] = v
    return flat


def _apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in the nested dict `raw`, creating sections as needed."""
    key, sep, text = override.removeprefix("--").partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r} must look like section.key=value")
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        raise ConfigError(f"override {override!r}: {text!r} is not a valid YAML value") from None
    *sections, name = key.split(".")
    node = raw
    for i, section in enumerate(sections):
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(sections[: i + 1])} is not a section")
    node[name] = value


_EXPECTED = {  # pydantic's error type -> what the key takes
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "an integer"),
    **dict.fromkeys(("float_type", "float_parsing"), "a number"),
    **dict.fromkeys(("bool_type", "bool_parsing"), "true or false"),
    **dict.fromkeys(("list_type", "tuple_type"), "a list"),
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping (a config section)",
}
_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def _describe(error: dict[str, Any], root: type[BaseModel]) -> str:
    """One line for a pydantic error: dotted key, what was expected, what was given."""
    loc = error["loc"]
    path, owner, section = _dotted(loc, root)
    kind, got = error["type"], error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        name = str(loc[-1])
        close = _suggest(name, list(owner.model_fields)) if owner else None
        prefix = path[: -len(name)]
        return f"unknown key {path}" + (f" (did you mean {prefix}{close}?)" if close else "")
    if kind == "missing" and isinstance(loc[-1], int):  # a too-short tuple reports its first gap
        return f"{path.rsplit('[', 1)[0]}: too few items, got {got!r}"
    if kind == "missing":
        return f"{path}: required key is missing"
    if kind in _EXPECTED:
        expected = _EXPECTED[kind]
    elif kind in _BOUNDS:
        bound, op = _BOUNDS[kind]
        limit = ctx[bound]
        expected = f"a value {op} {limit:g}" if isinstance(limit, float) else f"a value {op} {limit}"
    elif kind == "literal_error":
        expected = ctx["expected"]
    elif kind in ("too_short", "too_long") and "max_length" in ctx:
        expected = f"a list of {ctx['max_length']} items"
    else:  # our validators: the message is the explanation; a section's names its own keys
        message = error["msg"].removeprefix("Value error, ")
        return message if section or not path else f"{path}: {message}"
    return f"{path}: expected {expected}, got {got!r}"


def _dotted(loc: tuple[str | int, ...], root: type[BaseModel]) -> tuple[str, type[BaseModel] | None, bool]:
    """`("optim", "betas", 0)` -> ("optim.betas[0]", OptimSection, False): the dotted key, the
    section class holding its last name, and whether the key is itself a section.

    Parts that are not field names (pydantic's union-member tags) are skipped.
    """
    path, owner, cls, section = "", None, root, False
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif cls is not None and (part in cls.model_fields or part == loc[-1]):
            path += f".{part}" if path else part
            owner = cls
            annotation = cls.model_fields[part].annotation if part in cls.model_fields else None
            cls = _section_class(annotation)  # an optional section's keys are dotted too (lora.r)
            # (a whole optional section's own errors keep the "section: " prefix: not required)
            section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return path, owner, section and bool(loc)


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The section class of a field's annotation: ``S`` or an optional ``S | None``."""
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _suggest(name: str, candidates: list[str]) -> str | None:
    """The candidate `name` was probably meant as: same initials (learning_rate -> lr) or similar."""
    initials = "".join(word[0] for word in name.split("_") if word)
    for candidate in candidates:
        if candidate == initials or name == "".join(w[0] for w in candidate.split("_") if w):
            return candidate
    close = difflib.get_close_matches(name, candidates, n=1)
    return close[0] if close else None
