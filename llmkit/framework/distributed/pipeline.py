"""Pipeline parallelism: a model cut into stages on the ``pp`` dim of a mesh, run by a schedule.

A model describes itself as a chain (:class:`PipelineParts`, written by the model package): a
``first`` piece (batch inputs -> hidden), ``blocks`` (hidden -> hidden) and a ``last`` piece
(hidden, targets -> mean loss). A :class:`Pipeline` cuts the blocks into ``pp * v`` consecutive
stages (layer ranges given, or balanced by the pieces' costs), the first stage also holding
``first`` and the last ``last``; stage ``s`` lives on the ranks at ``pp`` coordinate ``s % pp``.

Each rank runs its job list (``pipeline_schedule.py``) with :class:`RankPipeline`: a forward job receives
its input activation from the previous stage's rank (or takes the micro-batch), runs the stage
and sends the output on; a backward job receives the output's gradient, runs autograd through
the stage (gradients accumulate in the parameters' ``.grad``: gradient accumulation over the
micro-batches) and sends the input's gradient back. Under a zero-bubble schedule the backward
defers the weight gradients (autograd's ``defer``) to the W job. Messages are tagged by kind,
stage and micro-batch, so a rank may take them in its own order; sends never wait.

The ranks of one stage (its ``dp x tp`` sub-mesh) lay the stage out as a ``layout`` says (the
training plan's placements); activations then cross between stages shard by shard, each rank
sending its shard to the rank at the same coordinate of the next stage. Under ``sim`` every rank
runs on its own thread (``dist.run_ranks``) with its own copy of its stages, as under ``mpi``
every process has its own.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..nn import Layer, LayerDict
from ..opspec import Meta
from ..optim import clip_grad_norm_
from ..placement import Placement, ProcessMesh, local_shape
from ..tape import no_grad
from ..tensor import Tensor
from .api import from_local, reshard
from .comm import get_backend
from .dist_array import DistArray, local
from .pipeline_schedule import Job, Schedule, make_schedule
from .pipeline_stage import RUNNERS

ACTIVATION, GRADIENT = 0, 1  # message kinds (part of each message's tag)


class PipelineError(ValueError):
    """A pipeline that cannot be built: the message names the setting (``pp_stages``...)."""


# ---- what a model says about itself -------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Part of a model a stage holds whole: the members it uses (dotted names in the model of
    sublayers, or of tensors it reads, such as buffers) and ``run(layers, *inputs)``, where
    ``layers`` maps those names to the rank's own (under ``sim``: copied, as tracing a stage on one
    thread must never touch another's tensors)."""

    layers: tuple[str, ...]
    run: Callable[..., Tensor]
    cost: float = 1.0  # relative forward compute, for balancing stages


@dataclass(frozen=True)
class PipelineParts:
    """A model as a chain: ``first(inputs)`` -> hidden, ``blocks`` hidden -> hidden, and
    ``last(hidden, targets)`` -> the mean loss of the micro-batch. ``boundary(input_shape)`` is
    the shape and dtype of the hidden state that crosses between stages."""

    model: Layer
    first: Piece
    blocks: tuple[Piece, ...]
    last: Piece
    boundary: Callable[[tuple[int, ...]], Meta]


# ---- stages ---------------------------------------------------------------------------------------------

_RANGE = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")


def parse_stages(spec: Sequence[Any], n_blocks: int, n_stages: int) -> tuple[range, ...]:
    """``["0-11", "12-23"]`` (inclusive layer ranges, one per stage, in order, covering every
    layer) -> ranges. An int ``k`` means the one layer ``k``."""
    if len(spec) != n_stages:
        raise PipelineError(f"pp_stages: {len(spec)} ranges for {n_stages} stages (pp x virtual_stages)")
    out = []
    for i, item in enumerate(spec):
        m = _RANGE.fullmatch(str(item)) if not isinstance(item, int) else None
        lo, hi = (item, item) if isinstance(item, int) else (int(m[1]), int(m[2])) if m else (None, None)
        if lo is None:
            raise PipelineError(f"pp_stages[{i}]: {item!r} is not a layer range like '0-11'")
        out.append(range(lo, hi + 1))
    want = 0
    for i, r in enumerate(out):
        if r.start != want or len(r) < 1:
            raise PipelineError(
                f"pp_stages[{i}]: {spec[i]!r} should start at layer {want} (stages are consecutive, "
                "non-empty, in order)"
            )
        want = r.stop
    if want != n_blocks:
        raise PipelineError(f"pp_stages: the ranges cover layers 0-{want - 1}; the model has {n_blocks}")
    return tuple(out)


def balance(costs: Sequence[float], n_stages: int, head: float = 0.0, tail: float = 0.0) -> tuple[range, ...]:
    """Consecutive non-empty ranges of ``costs`` (the blocks), one per stage, minimizing the
    costliest stage, where the first stage also costs ``head`` and the last ``tail`` (dynamic
    programming over split points; ties go to the earliest split)."""
    n = len(costs)
    if n < n_stages:
        raise PipelineError(f"{n_stages} stages need at least as many layers; the model has {n}")
    pre = np.concatenate([[0.0], np.cumsum(costs)])
    inf = float("inf")
    # best[k][j]: the least max-cost of cutting blocks[:j] into k stages; cut[k][j] its last split
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                c = pre[j] - pre[i] + (head if k == 1 else 0.0) + (tail if j == n and k == n_stages else 0.0)
                v = max(best[k - 1][i], c)
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    bounds = [n]
    for k in range(n_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return tuple(range(a, b) for a, b in itertools.pairwise(bounds))


def stage_layers(model: Layer, names: Sequence[str]) -> Layer:
    """A Layer holding the members ``names`` of ``model`` (sublayers, or tensors such as buffers a
    piece reads) under the same dotted names, so a plan's globs and a checkpoint's names apply to a
    stage as to the whole model."""
    root = LayerDict()
    for name in names:
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if part not in node:
                node[part] = LayerDict()
            node = node[part]
        m = member(model, name)
        if isinstance(m, Layer):
            node[leaf] = m
        else:
            node.register_buffer(leaf, m, persistent=False)
    return root


def member(model: Layer, name: str) -> Any:
    """The sublayer, parameter or buffer at dotted ``name``."""
    m: Any = model
    for part in name.split("."):
        m = m._sublayers[part] if part in m._sublayers else getattr(m, part)
    return m


# ---- how a stage's ranks lay it out ----------------------------------------------------------------------


def all_reduce(group: tuple[int, ...], rank: int, a: Any, op: str, what: str) -> Any:
    """``rank``'s share of an all-reduce of arrays of any shape (0-d too) over ``group``."""
    a = np.asarray(a) if not hasattr(a, "reshape") else a
    return get_backend().all_reduce(group, {rank: a.reshape(-1)}, op, what)[rank].reshape(a.shape)


def mesh_value(t: Tensor) -> np.ndarray:
    """The global value of ``t`` on this rank (a thread's under ``sim``), gathered over its own mesh
    alone: a stage's ranks use it where ``dist.unshard``, a collective of every process, would wait
    for (or leave messages to) the other stages' ranks. A plain tensor's own array."""
    x = t._data
    if not isinstance(x, DistArray):
        return np.asarray(x)
    (rank,) = get_backend().hosted(x.mesh.ranks)
    with no_grad():
        whole = reshard(t, x.mesh, ["R"] * x.mesh.ndim)
    return np.asarray(whole._data.shards[rank])


class Layout(Protocol):
    """How the ranks of one stage hold it (built as ``layout(stage_layers, stage_mesh)``)."""

    def batch(self, read: Callable[[slice], tuple[np.ndarray, ...]], batch_size: int) -> tuple[Tensor, ...]:
        """A global micro-batch placed, from ``read(rows)`` giving only the rows asked for."""
        ...

    @property
    def batch_placements(self) -> Sequence[Placement] | None:
        """The placements of a batch and of the activations between stages on the stage's mesh;
        None: plain tensors (each rank's own rows)."""
        ...

    def loss(self, t: Tensor) -> float:
        """The stage's loss value (a collective over the stage's ranks)."""
        ...

    def reduce_grads(self) -> None: ...

    def settle(self) -> None: ...


class Replicas:
    """Each rank of the stage holds it whole (data parallel, as Megatron's pipeline stages): a rank
    takes its contiguous share of a micro-batch's rows, and the gradients and the loss are averaged
    over the stage's ranks. On one rank, plain training."""

    batch_placements = None

    def __init__(self, layer: Layer, mesh: ProcessMesh) -> None:
        self.layer, self.mesh = layer, mesh
        self.group = tuple(mesh.ranks)
        (self.rank,) = get_backend().hosted(mesh.ranks)

    def batch(self, read, batch_size):
        n, i = len(self.group), self.group.index(self.rank)
        if batch_size % n:
            raise PipelineError(
                f"a micro-batch of {batch_size} rows cannot be split over {n} data-parallel ranks"
            )
        return tuple(Tensor(a) for a in read(slice(i * batch_size // n, (i + 1) * batch_size // n)))

    def _avg(self, a: np.ndarray, what: str) -> np.ndarray:
        return a if len(self.group) == 1 else all_reduce(self.group, self.rank, a, "avg", what)

    def loss(self, t: Tensor) -> float:
        return float(self._avg(np.asarray(t._data), "pipeline loss over dp"))

    def reduce_grads(self) -> None:
        for p in self.layer.parameters():
            if p.grad is not None and len(self.group) > 1:
                p.grad = Tensor(self._avg(p.grad._data, "gradient all-reduce over dp"))

    def settle(self) -> None:
        pass


# ---- the pipeline ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pipeline:
    """``parts`` cut into ``schedule.stages`` stages (``stages[s]``: the blocks of stage ``s``) on
    ``mesh`` (a dim named ``pp`` of size ``schedule.pp``; the other dims are each stage's ranks)."""

    parts: PipelineParts
    mesh: ProcessMesh
    schedule: Schedule
    stages: tuple[range, ...]

    @classmethod
    def build(
        cls,
        parts: PipelineParts,
        mesh: ProcessMesh,
        schedule: str = "1f1b",
        micro_batches: int = 1,
        virtual_stages: int = 1,
        stages: Sequence[Any] | None = None,
    ) -> Pipeline:
        """The pipeline of ``parts`` on ``mesh``; ``stages``: layer ranges (``["0-1", "2-3"]``),
        or None to balance the blocks by cost."""
        if "pp" not in mesh.dim_names:
            raise PipelineError(f"the mesh {mesh!r} has no 'pp' dim")
        pp = mesh.size("pp")
        sched = make_schedule(schedule, pp, micro_batches, virtual_stages)
        if stages is None:
            ranges = balance([b.cost for b in parts.blocks], sched.stages, parts.first.cost, parts.last.cost)
        else:
            ranges = parse_stages(stages, len(parts.blocks), sched.stages)
        return cls(parts, mesh, sched, ranges)

    def pieces(self, stage: int) -> list[Piece]:
        """The pieces stage ``stage`` runs, in order."""
        ps = [self.parts.blocks[i] for i in self.stages[stage]]
        if stage == 0:
            ps.insert(0, self.parts.first)
        if stage == self.schedule.stages - 1:
            ps.append(self.parts.last)
        return ps

    def stage_cost(self, stage: int) -> float:
        return sum(p.cost for p in self.pieces(stage))

    def describe(self) -> str:
        """``stage 0 (pp 0): layers 0-1 + first``... one line per stage."""
        lines = []
        last = self.schedule.stages - 1
        for s, r in enumerate(self.stages):
            extra = (" + first" if s == 0 else "") + (" + last" if s == last else "")
            lines.append(f"stage {s} (pp {s % self.schedule.pp}): layers {r.start}-{r.stop - 1}{extra}")
        return "\n".join(lines)

    def for_rank(
        self,
        rank: int,
        layout: Callable[[Layer, ProcessMesh], Any] | None = None,
        mode: str = "eager",
        compiler: str | None = None,
    ) -> RankPipeline:
        """What rank ``rank`` runs. Under ``sim`` (ranks on threads of one process) its stages'
        layers are copies, so every rank owns its parameters, as every process does under MPI.
        ``layout(stage_layers, stage_mesh)`` places them (None: :class:`Replicas`, data parallel).
        ``mode``: "eager" (autograd) or "static" (each stage's jobs as compiled programs, with
        ``compiler`` as ``to_static`` takes it)."""
        if mode not in RUNNERS:
            raise PipelineError(f"mode {mode!r}: use one of {', '.join(RUNNERS)}")
        return RankPipeline(self, rank, layout, mode, compiler)


class RankPipeline:
    """One rank's stages, its job list, and the messages to and from its neighbours."""

    def __init__(
        self,
        pipe: Pipeline,
        rank: int,
        layout: Callable[[Layer, ProcessMesh], Any] | None,
        mode: str = "eager",
        compiler: str | None = None,
    ) -> None:
        self.pipe, self.rank, self.compiler = pipe, rank, compiler
        mesh, sched = pipe.mesh, pipe.schedule
        coord = mesh.coord(rank)
        self.pp_dim = mesh.dim("pp")
        self.pp_rank = coord[self.pp_dim]
        self.stage_mesh = mesh["pp", self.pp_rank]
        self.my_stages = [s for s in range(sched.stages) if sched.rank_of(s) == self.pp_rank]
        names = [n for s in self.my_stages for p in pipe.pieces(s) for n in p.layers]
        names = list(dict.fromkeys(names))  # a tied weight's layer may serve two pieces
        held = stage_layers(pipe.parts.model, names)
        self.layers = copy.deepcopy(held) if get_backend().name == "sim" else held
        self.named = {n: member(self.layers, n) for n in names}
        # layers held by several pipeline ranks (a tied embedding, on the first and last stage):
        # their gradients are summed over the holders, and counted once in the gradient norm
        holders: dict[str, set[int]] = {}
        for s in range(sched.stages):
            for n in (n for p in pipe.pieces(s) for n in p.layers):
                holders.setdefault(n, set()).add(sched.rank_of(s))
        self.shared = {
            n: tuple(sorted(holders[n]))
            for n in names
            if len(holders[n]) > 1 and isinstance(self.named[n], Layer) and self.named[n].parameters()
        }
        self.layout = (layout or Replicas)(self.layers, self.stage_mesh)
        self.params = {id(p) for p in self.layers.parameters()}
        self.jobs = sched.jobs[self.pp_rank]
        self.runners = {s: RUNNERS[mode](self, s) for s in self.my_stages}
        self.losses: list[Tensor] = []
        self.peak_held = 0  # the most micro-batches' activations held at once (the schedule's memory)

    # ---- neighbours -----------------------------------------------------------------------------
    def peer(self, pp: int) -> int:
        """The rank at pipeline coordinate ``pp`` and this rank's coordinate of the stage mesh."""
        return self.pipe.mesh["pp", pp].ranks[self.stage_mesh.ranks.index(self.rank)]

    def rank_of_stage(self, stage: int) -> int:
        return self.peer(self.pipe.schedule.rank_of(stage))

    def _tag(self, kind: int, stage: int, micro: int) -> int:
        sched = self.pipe.schedule
        return ((kind * sched.stages + stage) * sched.micro_batches + micro) % 20000

    def _send(self, kind: int, stage: int, micro: int, to: int, t: Tensor) -> None:
        ps = self.layout.batch_placements
        if ps is not None:  # e.g. a Partial sum over tp reduced, as the receiver expects
            with no_grad():
                t = reshard(t, self.stage_mesh, ps)
        what = f"pipeline send to rank {to}"
        get_backend().send(self.rank, to, local(t, self.rank), what, self._tag(kind, stage, micro))

    def local_boundary_shape(self) -> tuple[int, ...]:
        """This rank's shape of an activation crossing between stages."""
        meta, ps, sm = self.boundary, self.layout.batch_placements, self.stage_mesh
        return meta.shape if ps is None else local_shape(meta.shape, sm.shape, ps, sm.coord(self.rank))

    def _recv(self, kind: int, stage: int, micro: int, frm: int) -> Tensor:
        meta, ps, sm = self.boundary, self.layout.batch_placements, self.stage_mesh
        shape = self.local_boundary_shape()
        what = f"pipeline recv from rank {frm} (stage {stage}, micro-batch {micro})"
        a = get_backend().recv(frm, self.rank, shape, meta.dtype, what, self._tag(kind, stage, micro))
        return Tensor(a) if ps is None else from_local({self.rank: a}, sm, ps, meta.shape)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self, inputs: np.ndarray, targets: np.ndarray) -> float:
        """This rank's jobs over one batch (``inputs``/``targets``: the global arrays ``[B, ...]``,
        alike on every rank): parameter gradients accumulate in ``.grad`` (the micro-batches'
        losses are scaled by ``1/m``, so they sum to the batch mean's gradient). Returns the batch
        loss on every rank (a collective over the pipeline)."""
        self._begin(inputs, targets, training=True)
        for job in self.jobs:
            RUN[job.kind](self, job)
        get_backend().flush()
        return self._loss()

    def evaluate(self, inputs: np.ndarray, targets: np.ndarray) -> float:
        """The batch loss without gradients: this rank's forward jobs alone, in its schedule's order
        (a subsequence of a deadlock-free order is one), every stage run eagerly."""
        self._begin(inputs, targets, training=False)
        with no_grad():
            for job in self.jobs:
                if job.kind == "F":
                    self.forward(job)
        get_backend().flush()
        return self._loss()

    def _begin(self, inputs: np.ndarray, targets: np.ndarray, training: bool) -> None:
        m = self.pipe.schedule.micro_batches
        if len(inputs) % m:
            raise PipelineError(f"a batch of {len(inputs)} rows cannot be cut into {m} equal micro-batches")
        rows = len(inputs) // m
        self.micro = [
            (inputs[i * rows : (i + 1) * rows], targets[i * rows : (i + 1) * rows]) for i in range(m)
        ]
        self.training = training
        self.boundary = self.pipe.parts.boundary(tuple(self._batch(0)[0].shape))  # global or own rows
        self.held: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self.deferred: dict[tuple[int, int], list] = {}
        self.losses = []

    def _batch(self, micro: int) -> tuple[Tensor, Tensor]:
        x, y = self.micro[micro]
        return self.layout.batch(lambda rows: (x[rows], y[rows]), len(x))

    def forward(self, job: Job) -> None:
        s, i = job.stage, job.micro
        last = s == self.pipe.schedule.stages - 1
        if s == 0:
            x, target = self._batch(i)
        else:
            x = self._recv(ACTIVATION, s - 1, i, self.rank_of_stage(s - 1))
            x.requires_grad = self.training
            target = self._batch(i)[1] if last else None
        if self.training:
            y, self.held[(s, i)] = self.runners[s].forward(x, target)
            self.peak_held = max(self.peak_held, len(self.held))
        else:
            y = self.runners[s].run(x, target)
        if last:
            self.losses.append(y.detach())
        else:
            self._send(ACTIVATION, s, i, self.rank_of_stage(s + 1), y)

    def backward(self, job: Job) -> None:
        s, i = job.stage, job.micro
        split = self.pipe.schedule.split_backward
        state = self.held[(s, i)] if split else self.held.pop((s, i))
        last = s == self.pipe.schedule.stages - 1
        g = None if last else self._recv(GRADIENT, s + 1, i, self.rank_of_stage(s + 1))
        dx, pending = self.runners[s].backward(state, g, split)
        if split:
            self.deferred[(s, i)] = pending
        if s > 0:
            self._send(GRADIENT, s, i, self.rank_of_stage(s - 1), dx)

    def weight(self, job: Job) -> None:
        key = (job.stage, job.micro)
        self.runners[job.stage].weight(self.deferred.pop(key))
        self.held.pop(key)

    # ---- after the jobs -------------------------------------------------------------------------------
    def pp_group(self) -> tuple[int, ...]:
        """The ranks of every stage at this rank's stage-mesh coordinate."""
        return self.pipe.mesh.group(self.rank, "pp")

    def _pp_sum(self, value: np.ndarray, what: str) -> np.ndarray:
        return all_reduce(self.pp_group(), self.rank, value, "sum", what)

    def _loss(self) -> float:
        total = np.zeros((), np.float64)
        for loss in self.losses:
            total += self.layout.loss(loss)
        return float(self._pp_sum(total, "pipeline loss"))

    def parameters(self) -> list[Tensor]:
        return list(self.layers.parameters())

    def norm_parameters(self) -> list[Tensor]:
        """The parameters whose gradients this rank counts in the global norm (a shared layer's
        on its first holder only)."""
        skip = {
            id(p)
            for n, holders in self.shared.items()
            if holders[0] != self.pp_rank
            for p in self.named[n].parameters()
        }
        return [p for p in self.parameters() if id(p) not in skip]

    def reduce_grads(self) -> None:
        """Gradients to the layout's (dp all-reduce...), and a layer held by several stages (tied
        embeddings) gets the sum of its holders' gradients."""
        self.layout.reduce_grads()
        for n, holders in self.shared.items():
            group = tuple(self.peer(h) for h in holders)
            for p in self.named[n].parameters():
                p.grad = self._own_sum(p.grad, group, f"shared {n} gradient")

    def settle(self) -> None:
        self.layout.settle()

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """``clip_grad_norm_`` over the whole pipeline: the norm of every stage's gradients (a
        shared layer's once), the same scale applied on every rank; returns the norm."""
        counted = self.norm_parameters()
        norm = clip_grad_norm_(counted, max_norm, reduce=self._pp_squares)
        ids = {id(p) for p in counted}
        rest = [p for p in self.parameters() if id(p) not in ids]
        if rest:  # the other holders' copies of a shared layer: the same total, so the same scale
            clip_grad_norm_(rest, max_norm, reduce=lambda _: self._squares)
        return norm

    def _pp_squares(self, sq: Tensor) -> Tensor:
        """A stage's sum of squared gradients -> the pipeline's (summed over the pp ranks)."""
        self._squares = self._own_sum(sq, self.pp_group(), "pipeline gradient norm")
        return self._squares

    def _own_sum(self, t: Tensor, group: tuple[int, ...], what: str) -> Tensor:
        """``t`` with this rank's array summed over ``group`` (a distributed tensor's own shard)."""
        x = t._data
        total = all_reduce(group, self.rank, local(t, self.rank), "sum", what)
        return Tensor(x.with_shards({self.rank: total}) if isinstance(x, DistArray) else total)


RUN: Mapping[str, Callable[[RankPipeline, Job], None]] = {
    "F": RankPipeline.forward,
    "B": RankPipeline.backward,
    "W": RankPipeline.weight,
}
