"""Pipeline-parallel training: the trainer's step, evaluation and checkpoint tensors when the plan
has a pipeline (``parallel.pp > 1``).

Every process builds the whole model (so every mesh starts from the single-process weights); each
pipeline rank it hosts (its own under MPI; under ``sim`` every rank, each on its own thread, as
``dist.run_ranks`` runs them) takes its stages (``framework/distributed/pipeline.py``), laid out on
the stage's ``dp x tp`` ranks: whole replicas when the plan shards nothing, else the plan's
placements (``Parallelized`` on the stage's mesh: tp, sp, ZeRO), with its own optimizer and
learning-rate schedule over its stages' parameters. A step runs the rank's job list, reduces the
gradients (over dp; a tied embedding over its holders), clips by the norm of the whole pipeline
and updates. The loss lives on the last stage; it is summed over the pipeline, so every rank
(rank 0, which logs) reports the batch's mean loss.

Checkpoints hold the tensors any other run writes, under the same names: each rank writes the
pieces it owns (``shard_files.save_shards``: its stages' parameters from the dp-index-0 ranks, a
tied embedding from its first holder), and the optimizer's moments are named by their parameter's
index in the whole model's optimizer (``state.<j>.<key>``), so a checkpoint of any pipeline, mesh or
single process resumes on any other (``ShardReader`` reads each rank's slices).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework import nn, optim
from llmkit.framework.distributed.dist_array import DistArray, held_bytes
from llmkit.framework.distributed.parallel_plan import ParallelPlan
from llmkit.framework.distributed.parallelize import Parallelized
from llmkit.framework.distributed.pipeline import Pipeline, RankPipeline, all_reduce, mesh_value
from llmkit.framework.distributed.shard_files import ShardReader, save_shards
from llmkit.framework.placement import Replicate
from llmkit.models.llama.pipeline_parts import pipeline_parts


class PlanLayout(Parallelized):
    """A stage laid out by the training plan on its ``dp x tp`` ranks (a pipeline ``Layout``)."""

    def loss(self, t: lf.Tensor) -> float:
        return float(mesh_value(t))


@dataclass
class RankState:
    """One pipeline rank's part of the run."""

    rp: RankPipeline
    optimizer: optim.Optimizer
    schedule: optim.LRScheduler
    names: dict[int, str]  # id(parameter) -> its name in the whole model
    written: set[str]  # the parameters whose pieces this rank writes (a tied one: its first holder)


class Schedules:
    """The hosted ranks' lr schedules (one per rank's optimizer, all alike), as one."""

    def __init__(self, schedules: list[optim.LRScheduler]) -> None:
        self.all = schedules

    def step(self) -> None:
        for s in self.all:
            s.step()

    def state_dict(self) -> dict[str, Any]:
        return self.all[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s in self.all:
            s.load_state_dict(state)


class PipelineRun:
    """The hosted pipeline ranks of ``model`` under ``plan``. ``make_optimizer(layer)`` and
    ``make_schedule(optimizer)`` build a rank's optimizer and lr schedule as the trainer builds the
    whole model's; ``groups``: the whole model's parameter names by optimizer group, in its order."""

    def __init__(
        self,
        model: nn.Layer,
        plan: ParallelPlan,
        seq_len: int,
        make_optimizer: Callable[[nn.Layer], optim.Optimizer],
        make_schedule: Callable[[optim.Optimizer], optim.LRScheduler],
        groups: list[list[str]],
        mode: str = "eager",
        compiler: str | None = None,
    ) -> None:
        p = plan.pipeline
        assert p is not None
        self.groups = groups
        self.order = {n: j for j, n in enumerate(n for g in groups for n in g)}
        self.mesh = plan.pipeline_mesh()
        parts = pipeline_parts(model, seq_len)
        self.pipe = Pipeline.build(parts, self.mesh, p.schedule, p.micro_batches, p.virtual_stages, p.stages)
        sharded = plan.size("tp") > 1 or plan.zero > 0
        layout = (lambda layer, mesh: PlanLayout(layer, plan, mesh)) if sharded else None

        def build(r: int) -> RankState:
            rp = self.pipe.for_rank(r, layout, mode, compiler)
            opt = make_optimizer(rp.layers)
            if isinstance(rp.layout, PlanLayout):
                rp.layout.shard_optimizer(opt)
            names = {id(t): n for n, t in rp.layers.named_parameters()}
            others = {n for n, holders in rp.shared.items() if holders[0] != rp.pp_rank}
            written = {n for n in names.values() if not any(n.startswith(o + ".") for o in others)}
            return RankState(rp, opt, make_schedule(opt), names, written)

        self.ranks = self.each(build)
        self.first = self.ranks[min(self.ranks)]
        self.schedules = Schedules([s.schedule for s in self.ranks.values()])

    def each(self, fn: Callable[[int], Any]) -> dict[int, Any]:
        """``fn(rank)`` for every hosted rank: on one thread each under ``sim``, else this process's."""
        comm = dist.get_backend()
        if comm.name == "sim":
            return dist.run_ranks(self.mesh.ranks, fn)
        return {r: fn(r) for r in comm.hosted(self.mesh.ranks)}

    def describe(self) -> str:
        return f"{self.pipe.describe()}\n{self.pipe.schedule}"

    # ---- training ---------------------------------------------------------------------------------
    def step(self, x: np.ndarray, y: np.ndarray, clip: float) -> tuple[float, float, int]:
        """One optimizer step on the global batch ``x, y``: (loss, gradient norm, the parameter +
        gradient + optimizer-state bytes of the fullest rank)."""

        def body(r: int) -> tuple[float, float, int]:
            s = self.ranks[r]
            loss = s.rp.step(x, y)
            s.rp.reduce_grads()
            norm = float(mesh_value(s.rp.clip_grad_norm(clip)))
            params = s.rp.parameters()
            held = state_bytes(r, params, s.optimizer)
            fullest = all_reduce(tuple(self.mesh.ranks), r, np.array(held, np.int64), "max", "state bytes")
            s.optimizer.step()
            s.rp.settle()
            s.optimizer.zero_grad()
            return loss, norm, int(fullest)

        return self.each(body)[min(self.ranks)]

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> float:
        return self.each(lambda r: self.ranks[r].rp.evaluate(x, y))[min(self.ranks)]

    # ---- checkpoints ------------------------------------------------------------------------------
    def save(self, model_dir: Path, optimizer_dir: Path) -> None:
        """Every hosted rank writes the pieces it owns of its parameters and optimizer moments."""

        def body(r: int) -> None:
            s = self.ranks[r]
            mesh = s.rp.stage_mesh
            params = {n: _placed(t, mesh, r) for n, t in s.rp.layers.named_parameters() if n in s.written}
            save_shards(params, model_dir)
            moments = {
                f"state.{self.order[s.names[id(p)]]}.{k}": _placed(t, mesh, r)
                for p, state in zip(s.optimizer.params, s.optimizer.states, strict=True)
                if s.names[id(p)] in s.written
                for k, t in state.items()
            }
            save_shards(moments, optimizer_dir)

        self.each(body)

    def optimizer_meta(self) -> dict[str, Any]:
        """The whole model's optimizer groups (hyperparameters, parameter indices) and step, as a
        one-process run's checkpoint records them (every rank's groups split alike)."""
        opt = self.first.optimizer
        groups = [
            {**{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"},
             "params": [self.order[n] for n in names]}
            for g, names in zip(opt.param_groups, self.groups, strict=True)
        ]  # fmt: skip
        return {"param_groups": groups, "step": int(opt.step_count.item())}

    def load(self, weights: ShardReader, moments: ShardReader, step: int) -> int:
        """Set every hosted rank's parameters and optimizer state (at optimizer ``step``) from a
        checkpoint of any layout; this run keeps its own hyperparameters. Returns the most bytes a
        rank read."""

        def body(r: int) -> int:
            s = self.ranks[r]
            read = 0

            def get(reader: ShardReader, key: str, name: str, kind: str, dtype: Any) -> lf.Tensor:
                nonlocal read
                t = _read(reader, key, s.rp, name, kind)
                read += held_bytes(r, [t])
                return t.astype(dtype)

            opt = s.optimizer
            state = {}
            for j, (p, own) in enumerate(zip(opt.params, opt.states, strict=True)):
                name = s.names[id(p)]
                key = f"state.{self.order[name]}"
                state[j] = {k: get(moments, f"{key}.{k}", name, "state", t.dtype) for k, t in own.items()}
            groups = [{**g, "params": list(range(len(g["params"])))} for g in opt.param_groups]  # its own
            opt.load_state_dict({"state": state, "param_groups": groups, "step": step})
            for n, p in s.rp.layers.named_parameters():
                p.set_value(get(weights, n, n, "param", p.dtype))
            return read

        return max(self.each(body).values())


def state_bytes(rank: int, params: list[lf.Tensor], opt: optim.Optimizer) -> int:
    """The bytes of ``params``, their gradients and ``opt``'s state that ``rank`` holds."""
    return held_bytes(
        rank, [*params, *(p.grad for p in params), *(t for s in opt.states for t in s.values())]
    )


def _placed(t: lf.Tensor, mesh: dist.ProcessMesh, rank: int) -> lf.Tensor:
    """``t`` as a distributed tensor on the stage's ``mesh`` (a replica's plain tensor: replicated)."""
    if isinstance(t._data, DistArray):
        return t
    return lf.Tensor(DistArray({rank: t._data}, mesh, [Replicate()] * mesh.ndim, t.shape, t.dtype))


def _read(reader: ShardReader, key: str, rp: RankPipeline, name: str, kind: str) -> lf.Tensor:
    """Tensor ``key`` of a checkpoint as the rank holds ``name``'s ``kind`` (param or state): whole
    on a replica, else the region of the plan's placement."""
    layout = rp.layout
    if not isinstance(layout, PlanLayout):
        return lf.Tensor(reader.read(key))
    return lf.Tensor(reader.read_placed(key, layout.mesh, layout.placements(name, kind)))
