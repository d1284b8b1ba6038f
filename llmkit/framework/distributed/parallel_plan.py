"""ParallelPlan: how training spreads one model over a mesh of ranks, as data.

A plan is

- the mesh: named dims and their sizes, ``{"dp": 2, "tp": 2}`` (data parallel x tensor parallel);
- ``params``: parameter-name globs -> the parameter's placement on the ``tp`` dim, first match wins
  (``"*.q_proj.weight": S(0)`` is column parallel: Linear weights are [out, in]); a glob ``"*"``
  last is the explicit default, and a parameter no glob matches is an error naming it;
- ``outputs``: layer-name globs -> the placement on ``tp`` its output is resharded to (the
  collectives of the Megatron pattern: a row-parallel product's partial sums all-reduced, or
  reduce-scattered over the sequence with sequence parallelism);
- ``zero``: the ZeRO stage, as placement policies on ``dp``: 1 shards the optimizer state, 2 also the
  gradients (reduce-scatter instead of all-reduce), 3 also the parameters (gathered when used);
- ``sp``: the sequence-parallel switch (recorded; the built-in plans resolve it into ``outputs``);
- ``pipeline``: pipeline parallelism (:class:`PipelinePlan`): ``pp`` stages of consecutive layers,
  each on its own ``dp x tp`` mesh laid out by the rules above, run by a schedule over micro-batches
  (``distributed/pipeline.py``). The whole mesh is then ``pp x dp x tp``, pp outermost.
- ``recompute``, ``recompute_every``: activation recomputation per layer (:data:`RECOMPUTE`): every
  ``recompute_every``-th layer (layers 0, k, 2k, ...) keeps only what the policy keeps and
  recomputes the rest in the backward; the model package applies it (its layers know their parts).

On ``dp`` a parameter is replicated (ZeRO 3: sharded); its gradient is the sum over the dp ranks'
rows. Training writes the plan as ``parallel_plan.json`` in every checkpoint; quantization and
serving read it back (``ParallelPlan.load``) and place weights the same way without re-planning.

Built-in plans (``plan: llama``) are registered by the model packages (``register_plan``), since
the framework knows no model; a user plan is a mapping ``{params: {glob: placement}, outputs:
{glob: placement}}`` (a YAML file or inline in the config).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import atomic_write
from ..placement import Partial, Placement, ProcessMesh, Replicate, Shard, local_shape

PLAN_FILE = "parallel_plan.json"
FORMAT, VERSION = "llmkit.parallel_plan", 1
MESH_DIMS = ("dp", "tp")  # data parallel (outer), tensor parallel (inner: neighbouring ranks)
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE = {  # policy -> what a recomputed layer keeps for its backward
    "none": "every activation",
    "attention": "its activations outside the attention block (recomputed from the block's input)",
    "full": "its input only (the whole layer is recomputed)",
}

Rules = tuple[tuple[str, Placement], ...]


class PlanError(ValueError):
    """A plan that cannot apply: ``key`` is the plan's key at fault (mesh, zero, sp, params,
    outputs, or "" for the whole plan) and the message names the glob or parameter."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key, self.message = key, message


@dataclass(frozen=True)
class PipelinePlan:
    """How the model is cut into pipeline stages and run (the config's ``parallel.pp*`` keys)."""

    pp: int  # pipeline ranks: the outermost mesh dim
    schedule: str = "1f1b"  # fthenb | 1f1b | interleaved | zero_bubble (distributed/pipeline_schedule.py)
    micro_batches: int = 1  # a step's batch cut into this many
    virtual_stages: int = 1  # stages per pipeline rank (interleaved)
    stages: tuple[str, ...] | None = None  # layer ranges, one per stage ("0-11"); None: balanced

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "stages": None if self.stages is None else list(self.stages)}

    @classmethod
    def from_json(cls, raw: Any) -> PipelinePlan:
        keys = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(raw, Mapping) or set(raw) != keys:
            raise PlanError("pipeline", f"expected a mapping with keys {sorted(keys)}, got {raw!r}")
        stages = raw["stages"]
        return cls(**{**raw, "stages": None if stages is None else tuple(map(str, stages))})


# Built-in plans: name -> fn(sp) -> (params rules, outputs rules), registered by model packages.
_PLANS: dict[str, Callable[[bool], tuple[Rules, Rules]]] = {}


def register_plan(name: str, rules: Callable[[bool], tuple[Any, Any]]) -> None:
    """Make ``plan: name`` mean ``rules(sp)`` -> (params, outputs), each a sequence of (glob, placement)."""

    def resolved(sp: bool) -> tuple[Rules, Rules]:
        params, outputs = rules(sp)
        return _rules(params, "params"), _rules(outputs, "outputs")

    _PLANS[name] = resolved


def builtin_plans() -> list[str]:
    return sorted(_PLANS)


def _placement(text: Any, section: str, glob: str) -> Placement:
    try:
        p = Placement.parse(text)
    except ValueError as e:
        raise PlanError(section, f"{glob!r}: {e}") from None
    if isinstance(p, Partial):
        raise PlanError(
            section, f"{glob!r}: {p} is not a layout to plan a weight or output to; use R or S(dim)"
        )
    return p


def _rules(raw: Any, section: str) -> Rules:
    """``{glob: "S(0)"}`` or ``[(glob, placement), ...]`` -> ordered (glob, Placement) pairs."""
    if raw is None:
        return ()
    items = raw.items() if isinstance(raw, Mapping) else raw
    out = []
    try:
        for glob, p in items:
            if not isinstance(glob, str) or not glob:
                raise PlanError(section, f"a glob must be a non-empty string, got {glob!r}")
            out.append((glob, _placement(p, section, glob)))
    except (TypeError, ValueError) as e:
        if isinstance(e, PlanError):
            raise
        raise PlanError(section, f"expected a mapping of glob -> placement, got {raw!r}") from None
    return tuple(out)


def _match(rules: Rules, name: str) -> tuple[str, Placement] | None:
    for glob, p in rules:
        if fnmatch.fnmatchcase(name, glob):
            return glob, p
    return None


# Low-rank adapters (LoRA): ``<layer>.lora_A`` [r, in] and ``<layer>.lora_B`` [out, r] beside the
# frozen ``<layer>.weight`` W [out, in], y = W x + s B (A x). A factor takes its layout from W's, so
# a plan needs no rule of its own for them: A shares W's dim 1 (in), B its dim 0 (out).
ADAPTER = re.compile(r"(?P<layer>.+)\.(?P<factor>lora_[AB])(\.weight)?")
ADAPTER_SHARED_DIM = {"lora_A": 1, "lora_B": 0}


def adapter_placement(factor: str, base: Placement) -> Placement:
    """The tp placement of adapter ``factor`` (lora_A, lora_B) of a weight placed ``base``:

    - column-parallel W (S(0), each rank a slice of the outputs): B S(0), A replicated, so each
      rank's B (A x) is its slice of the update's outputs, as W x is;
    - row-parallel W (S(1), each rank a slice of the inputs, partial sums): A S(1), B replicated, so
      A x is a partial sum over the ranks' inputs and B (A x) is reduced with W x's partial sums;
    - replicated W: both replicated.
    """
    shared = ADAPTER_SHARED_DIM[factor]
    return Shard(shared) if isinstance(base, Shard) and base.dim == shared else Replicate()


@dataclass(frozen=True)
class ParallelPlan:
    """Mesh, parameter and output rules, ZeRO stage, sequence parallelism (see the module docstring)."""

    mesh: tuple[tuple[str, int], ...] = (("dp", 1), ("tp", 1))  # (dim name, size), outer first
    params: Rules = ()  # parameter glob -> placement on tp
    outputs: Rules = ()  # layer glob -> placement of its output on tp
    zero: int = 0  # ZeRO stage over dp
    sp: bool = False  # sequence parallel between the tp regions
    name: str | None = None  # the built-in plan the rules came from; None for a user plan
    pipeline: PipelinePlan | None = None  # pipeline parallelism (pp > 1), or None
    recompute: str = "none"  # a key of RECOMPUTE
    recompute_every: int = 1  # the policy applies to layers 0, k, 2k, ...

    def __post_init__(self) -> None:
        names = [n for n, _ in self.mesh]
        if tuple(names) != MESH_DIMS:
            raise PlanError("mesh", f"dims must be {list(MESH_DIMS)}, got {names}")
        for n, s in self.mesh:
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise PlanError("mesh", f"{n} must be a positive integer, got {s!r}")
        if self.zero not in ZERO_STAGES:
            raise PlanError("zero", f"the ZeRO stage must be one of {list(ZERO_STAGES)}, got {self.zero!r}")
        if self.zero and self.size("dp") == 1:
            raise PlanError(
                "zero", f"ZeRO stage {self.zero} shards over data-parallel ranks; it needs dp > 1"
            )
        if self.sp and self.size("tp") == 1:
            raise PlanError(
                "sp", "sequence parallelism shards between tensor-parallel regions; it needs tp > 1"
            )
        if self.recompute not in RECOMPUTE:
            raise PlanError("recompute", f"must be one of {list(RECOMPUTE)}, got {self.recompute!r}")
        k = self.recompute_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise PlanError("recompute_every", f"must be a positive integer, got {k!r}")

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def make(
        cls,
        spec: str | Mapping[str, Any] = "llama",
        *,
        dp: int = 1,
        tp: int = 1,
        sp: bool = False,
        zero: int = 0,
        pipeline: PipelinePlan | None = None,
        recompute: str = "none",
        recompute_every: int = 1,
    ) -> ParallelPlan:
        """A plan from the config's ``parallel`` keys. ``spec``: a built-in plan's name, a YAML or
        JSON file of rules, or the rules themselves ``{params: {...}, outputs: {...}}``."""
        name = None
        if isinstance(spec, str) and spec in _PLANS:
            name = spec
            params, outputs = _PLANS[spec](sp)
        else:
            raw = _read_rules(spec) if isinstance(spec, (str, os.PathLike)) else spec
            if not isinstance(raw, Mapping):
                raise PlanError(
                    "",
                    f"expected a built-in plan ({', '.join(builtin_plans()) or 'none registered'}), "
                    f"a plan file or a mapping {{params: ..., outputs: ...}}, got {spec!r}",
                )
            unknown = sorted(set(raw) - {"params", "outputs"})
            if unknown:
                raise PlanError("", f"unknown key {unknown[0]!r} (a plan has params and outputs)")
            if not raw.get("params"):
                raise PlanError("params", "a plan needs at least one parameter rule (glob: placement)")
            params, outputs = _rules(raw["params"], "params"), _rules(raw.get("outputs"), "outputs")
        return cls(
            (("dp", dp), ("tp", tp)), params, outputs, zero, sp, name, pipeline, recompute, recompute_every
        )

    # ---- the mesh --------------------------------------------------------------------------------
    def size(self, dim: str) -> int:
        return dict(self.mesh)[dim]

    @property
    def pp(self) -> int:
        return 1 if self.pipeline is None else self.pipeline.pp

    @property
    def world_size(self) -> int:
        return self.pp * self.size("dp") * self.size("tp")

    @property
    def is_trivial(self) -> bool:
        """One rank: nothing to place."""
        return self.world_size == 1

    def process_mesh(self) -> ProcessMesh:
        """The ``dp x tp`` mesh (of one pipeline stage, when there are several)."""
        return ProcessMesh(tuple(s for _, s in self.mesh), [n for n, _ in self.mesh])

    def pipeline_mesh(self) -> ProcessMesh:
        """The whole ``pp x dp x tp`` mesh; stage ranks ``pipeline_mesh()["pp", k]``."""
        return ProcessMesh((self.pp, *(s for _, s in self.mesh)), ["pp", *(n for n, _ in self.mesh)])

    # ---- placements ------------------------------------------------------------------------------
    def tp_placement(self, name: str) -> Placement:
        """The tp placement of parameter ``name`` (first matching glob; a low-rank adapter's factor
        from its base weight's placement: :func:`adapter_placement`)."""
        adapter = ADAPTER.fullmatch(name)
        if adapter is not None:
            layer, factor = adapter.group("layer", "factor")
            return adapter_placement(factor, self.tp_placement(f"{layer}.weight"))
        hit = _match(self.params, name)
        if hit is None:
            globs = ", ".join(repr(g) for g, _ in self.params)
            raise PlanError(
                "params",
                f"parameter {name!r} matches no glob of the plan's params ({globs}); "
                "add a rule for it, or a last rule '*': R as the default",
            )
        return hit[1]

    def zero_dim(self, name: str, shape: Sequence[int]) -> int:
        """The tensor dim ZeRO shards over dp: dim 0 unless tp already shards it (then dim 1)."""
        tp = self.tp_placement(name)
        return 1 if isinstance(tp, Shard) and tp.dim == 0 and len(shape) > 1 else 0

    def _on_dp(self, name: str, shape: Sequence[int], sharded: bool) -> tuple[Placement, ...]:
        dp = Shard(self.zero_dim(name, shape)) if sharded and self.size("dp") > 1 else Replicate()
        return (dp, self.tp_placement(name))

    def param_placements(self, name: str, shape: Sequence[int]) -> tuple[Placement, ...]:
        """Where a parameter lives between steps: [dp, tp] (ZeRO 3 shards it over dp too)."""
        return self._on_dp(name, shape, self.zero >= 3)

    def grad_placements(self, name: str, shape: Sequence[int]) -> tuple[Placement, ...]:
        """Where its gradient is reduced to: replicated over dp (all-reduce), ZeRO 2+ sharded
        (reduce-scatter)."""
        return self._on_dp(name, shape, self.zero >= 2)

    def state_placements(self, name: str, shape: Sequence[int]) -> tuple[Placement, ...]:
        """Where its optimizer state lives (and the update runs): ZeRO 1+ sharded over dp."""
        return self._on_dp(name, shape, self.zero >= 1)

    def state_bytes(
        self,
        shapes: Mapping[str, Sequence[int]],
        itemsize: int = 4,
        moments: int = 2,
        state_itemsize: int = 4,
        frozen: Mapping[str, Sequence[int]] | None = None,
    ) -> int:
        """Parameter + gradient (``itemsize`` each) + optimizer-state bytes of the fullest rank
        (``moments`` tensors per parameter of ``state_itemsize``: AdamW's two float32 moments), from
        the placements alone; ``frozen`` parameters (a LoRA run's base) count their own bytes only."""
        mesh = [s for _, s in self.mesh]
        coords = [(i, j) for i in range(mesh[0]) for j in range(mesh[1])]
        per_rank = dict.fromkeys(coords, 0)
        for name, shape in [*shapes.items(), *(frozen or {}).items()]:
            trained = name in shapes
            for placements, nbytes in (
                (self.param_placements(name, shape), itemsize),
                (self.grad_placements(name, shape), itemsize * trained),
                (self.state_placements(name, shape), moments * state_itemsize * trained),
            ):
                for c in coords:
                    per_rank[c] += nbytes * math.prod(local_shape(shape, mesh, placements, c))
        return max(per_rank.values())

    def recompute_at(self, layer: int) -> str:
        """The recompute policy of decoder layer ``layer`` (a key of RECOMPUTE)."""
        return self.recompute if layer % self.recompute_every == 0 else "none"

    def recomputed_layers(self, n_layers: int) -> int:
        """How many of ``n_layers`` layers the policy recomputes."""
        return 0 if self.recompute == "none" else -(-n_layers // self.recompute_every)

    def output_placement(self, layer: str) -> Placement | None:
        """The tp placement a layer's output is resharded to, or None (left as the ops make it)."""
        hit = _match(self.outputs, layer)
        return None if hit is None else hit[1]

    def check(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Every parameter matches a rule whose shard dim exists and is at least tp long."""
        tp = self.size("tp")
        for name, shape in shapes.items():
            p = self.tp_placement(name)
            if isinstance(p, Shard):
                if not -len(shape) <= p.dim < len(shape):
                    raise PlanError("params", f"parameter {name!r} {list(shape)}: {p} is out of range")
                if shape[p.dim] < tp:
                    raise PlanError(
                        "params",
                        f"parameter {name!r} {list(shape)}: {p} cuts a dim of {shape[p.dim]} into tp={tp} "
                        "pieces, some of them empty",
                    )

    def describe(self) -> str:
        """One line: ``pp=2 x dp=2 x tp=2, 1f1b x 4 micro-batches, zero 1, sp, plan llama``."""
        p = self.pipeline
        dims = ([("pp", p.pp)] if p is not None else []) + list(self.mesh)
        parts = [" x ".join(f"{n}={s}" for n, s in dims)]
        if p is not None:
            virtual = f", {p.virtual_stages} stages per rank" if p.virtual_stages > 1 else ""
            parts.append(f"{p.schedule} x {p.micro_batches} micro-batches{virtual}")
        if self.zero:
            parts.append(f"zero {self.zero}")
        if self.sp:
            parts.append("sp")
        if self.recompute != "none":
            every = f" every {self.recompute_every} layers" if self.recompute_every > 1 else ""
            parts.append(f"recompute {self.recompute}{every}")
        parts.append(f"plan {self.name}" if self.name else "user plan")
        return ", ".join(parts)

    # ---- files -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "mesh": dict(self.mesh),
            "zero": self.zero,
            "sp": self.sp,
            "plan": self.name,
            "params": {g: str(p) for g, p in self.params},
            "outputs": {g: str(p) for g, p in self.outputs},
            "pipeline": None if self.pipeline is None else self.pipeline.to_json(),
            "recompute": self.recompute,
            "recompute_every": self.recompute_every,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str = PLAN_FILE) -> ParallelPlan:
        try:
            if raw.get("format") != FORMAT or raw.get("version") != VERSION:
                raise PlanError(
                    "",
                    f"format {raw.get('format')!r} version {raw.get('version')!r}; "
                    f"expected {FORMAT!r} version {VERSION}",
                )
            keys = {"format", "version", "mesh", "zero", "sp", "plan", "params", "outputs"}
            optional = {"pipeline", "recompute", "recompute_every"}  # absent from plans written before them
            if not keys <= set(raw) <= keys | optional:
                odd = sorted((set(raw) - keys - optional) | (keys - set(raw)))
                raise PlanError("", f"unexpected or missing keys {odd}")
            mesh = raw["mesh"]
            if not isinstance(mesh, Mapping):
                raise PlanError("mesh", f"expected a mapping of dim -> size, got {mesh!r}")
            if not isinstance(raw["sp"], bool):
                raise PlanError("sp", f"expected true or false, got {raw['sp']!r}")
            return cls(
                tuple(mesh.items()),
                _rules(raw["params"], "params"),
                _rules(raw["outputs"], "outputs"),
                raw["zero"],
                raw["sp"],
                raw["plan"],
                None if raw.get("pipeline") is None else PipelinePlan.from_json(raw["pipeline"]),
                raw.get("recompute", "none"),
                raw.get("recompute_every", 1),
            )
        except PlanError as e:
            raise PlanError("", f"{where}: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ParallelPlan:
        """Read ``parallel_plan.json`` (a checkpoint directory holding one works too)."""
        path = Path(path)
        if path.is_dir():
            path = path / PLAN_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PlanError("", f"{path}: no parallel plan there") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError("", f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise PlanError("", f"{path}: expected a JSON object")
        return cls.from_json(raw, str(path))


def _read_rules(path: str | os.PathLike[str]) -> Any:
    import yaml

    p = Path(path)
    if not p.is_file():
        known = ", ".join(builtin_plans()) or "none registered"
        raise PlanError("", f"{str(path)!r} is neither a built-in plan ({known}) nor a plan file")
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise PlanError("", f"{p}: not a YAML plan ({e})") from None
