"""A ParallelPlan applied to a model and its optimizer: training's state laid out, step by step.

    par = Parallelized(model, plan)           # parameters placed, output reshards hooked in
    par.shard_optimizer(optimizer)            # optimizer state in the plan's layout
    loss = model.loss(par.batch(rows), ...)   # each dp rank's rows of the global batch
    loss.backward()                           # gradients of replicated weights come back Partial
    par.reduce_grads()                        # P -> R (all-reduce), ZeRO 2+: P -> S (reduce-scatter)
    optimizer.step()                          # runs where the state lives (ZeRO 1+: a dp-th of it)
    par.settle()                              # parameters back to their layout (ZeRO 1+: all-gather)

Every move is a ``dist.reshard`` to a placement the plan names, so the same code is an eager step
on ``sim`` or ``mpi`` and traces into a static program. A program written per rank (one whose shapes
change from call to call, which the global view cannot partition: RLHF's steps) reduces its
gradients with :func:`all_reduce_grads`, the ``dist.all_reduce`` that ``reduce_grads``' P -> R
becomes in a partitioned program. ZeRO 3 keeps each parameter sharded over dp
and a layer gathers its own just before its forward (the gathered copy is dropped after it; autograd
keeps it for the backward unless the layer recomputes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..dispatch import apply
from ..nn.layer import Layer, replace_payload
from ..placement import Placement, ProcessMesh, Replicate, Shard
from ..tensor import Tensor
from .api import from_local, reshard, shard_tensor
from .comm import get_backend
from .dist_array import DistArray, held_bytes
from .parallel_plan import ParallelPlan


class Parallelized:
    """``model`` laid out on ``mesh`` (default: the plan's) by ``plan``."""

    def __init__(self, model: Layer, plan: ParallelPlan, mesh: ProcessMesh | None = None) -> None:
        self.model, self.plan = model, plan
        self.mesh = mesh if mesh is not None else plan.process_mesh()
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.shapes = {n: p.shape for n, p in model.named_parameters()}
        self.optimizer: Any = None
        self.place([n for n, p in model.named_parameters() if not isinstance(p._data, DistArray)])
        for name, layer in model.named_sublayers():
            out = plan.output_placement(name)
            if out is not None:
                layer.register_forward_hook(self._reshard_output(out))
            if plan.zero >= 3 and layer._parameters:
                layer.register_forward_pre_hook(self._gather_own)
                layer.register_forward_hook(self._release_own)

    def place(self, names: Sequence[str]) -> None:
        """Lay out parameters ``names``, each holding its whole value (every rank the same), as the
        plan places them (a checkpoint's values set after the layout: a LoRA run's adapters)."""
        params = dict(self.model.named_parameters())
        for name in names:
            p = params[name]
            replace_payload(p, shard_tensor(p, self.mesh, self.placements(name))._data)

    # ---- placements --------------------------------------------------------------------------
    def placements(self, name: str, kind: str = "param") -> tuple[Placement, ...]:
        """The plan's placements of parameter ``name``'s ``param``, ``grad`` or ``state``."""
        return getattr(self.plan, f"{kind}_placements")(name, self.shapes[name])

    def _with(self, placements: Sequence[Placement], dim: str, p: Placement) -> list[Placement]:
        out = list(placements)
        out[self.mesh.dim(dim)] = p
        return out

    # ---- forward hooks -----------------------------------------------------------------------
    # Every placement below comes from the plan, never from a value: under to_static the values are
    # traced and the static passes derive (and fold) the layouts.
    def _reshard_output(self, tp: Placement) -> Callable[..., Tensor]:
        """Activations are sharded on the batch over dp; the plan names their placement on tp."""
        batch = self._with(self.batch_placements, "tp", tp)

        def hook(layer: Layer, args: Any, out: Tensor) -> Tensor:
            return reshard(out, self.mesh, batch)

        return hook

    def _gather_own(self, layer: Layer, args: Any) -> None:
        """ZeRO 3: the layer's parameters gathered over dp for its forward (shadowing the shards)."""
        for key, p in layer._parameters.items():
            if p is not None:
                whole = self._with(self.placements(self.names[id(p)]), "dp", Replicate())
                object.__setattr__(layer, key, reshard(p, self.mesh, whole))

    def _release_own(self, layer: Layer, args: Any, out: Any) -> None:
        for key in layer._parameters:
            layer.__dict__.pop(key, None)

    # ---- data --------------------------------------------------------------------------------
    def dp_rows(self, batch_size: int) -> dict[int, slice]:
        """The rows of a global batch each hosted rank holds (its dp coordinate's chunk)."""
        n = self.mesh.size("dp")
        size = batch_size // n
        dp = self.mesh.dim("dp")
        return {r: slice(c[dp] * size, (c[dp] + 1) * size) for r, c in self._hosted_coords()}

    def batch(self, read: Callable[[slice], tuple[np.ndarray, ...]], batch_size: int) -> tuple[Tensor, ...]:
        """Global batch arrays [B, ...] placed (S(0) on dp, R on tp) from ``read(rows)``, which
        gives only the rows asked for: each process reads just the rows of the ranks it hosts."""
        parts: dict[int, tuple[np.ndarray, ...]] = {}
        cache: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        for r, s in self.dp_rows(batch_size).items():
            key = (s.start, s.stop)
            if key not in cache:
                cache[key] = tuple(read(s))
            parts[r] = cache[key]
        some = next(iter(parts.values()))
        return tuple(
            from_local(
                {r: p[i] for r, p in parts.items()},
                self.mesh,
                self.batch_placements,
                (batch_size, *a.shape[1:]),
            )
            for i, a in enumerate(some)
        )

    @property
    def batch_placements(self) -> list[Placement]:
        """A batch's (and an activation's): rows sharded over dp, replicated over tp."""
        return [Shard(0) if n == "dp" else Replicate() for n in self.mesh.dim_names]

    def _hosted_coords(self) -> Iterator[tuple[int, tuple[int, ...]]]:
        for r in get_backend().hosted(self.mesh.ranks):
            yield r, self.mesh.coord(r)

    # ---- the optimizer -----------------------------------------------------------------------
    def shard_optimizer(self, optimizer: Any) -> None:
        """Move the optimizer's state (made like its parameters) to the plan's state layout."""
        self.optimizer = optimizer
        self._settle(self._state_tensors())

    def _state_tensors(self) -> Iterator[tuple[Tensor, tuple[Placement, ...]]]:
        if self.optimizer is None:
            return
        for p, state in zip(self.optimizer.params, self.optimizer.states, strict=True):
            ps = self.placements(self.names[id(p)], "state")
            for t in state.values():
                yield t, ps

    def reduce_grads(self) -> None:
        """Every gradient to the plan's gradient layout: the sum over dp (and over tp where the
        weight is replicated but its uses were not) reduced (all-reduce or reduce-scatter)."""
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                p.grad = reshard(p.grad, self.mesh, self.placements(name, "grad"))

    def settle(self) -> None:
        """After an update: parameters and optimizer state back to their planned layouts."""
        params = ((p, self.placements(n)) for n, p in self.model.named_parameters())
        self._settle(params)
        self._settle(self._state_tensors())

    def _settle(self, pairs: Iterator[tuple[Tensor, Sequence[Placement]]]) -> None:
        for t, want in pairs:
            if t.is_concrete:  # state made before the parameters were placed
                replace_payload(t, shard_tensor(t, self.mesh, want)._data)
            else:  # a no-op where it is there already (folded away in a static program)
                t.set_value(reshard(t.detach(), self.mesh, want))

    # ---- memory ------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Parameter + gradient + optimizer-state bytes held by the fullest rank (collective)."""
        params = self.model.parameters()
        tensors = [*params, *(p.grad for p in params), *(t for t, _ in self._state_tensors())]
        comm = get_backend()
        mine = {r: np.array([held_bytes(r, tensors)], np.int64) for r in comm.hosted(self.mesh.ranks)}
        group = tuple(self.mesh.ranks)
        return int(next(iter(comm.all_reduce(group, mine, "max", "state_bytes").values()))[0])


def all_reduce_grads(params: Sequence[Tensor], group: Sequence[int]) -> None:
    """Data parallel in a per-rank program: each gradient replaced by its sum over the ranks of
    ``group`` (every rank's loss is its rows' share of the whole batch's, so the sum is the
    gradient of the whole batch). Eager or traced; every rank of ``group`` must call it."""
    ranks = tuple(group)
    for p in params:
        if p.grad is not None:
            p.grad = apply("all_reduce", p.grad, group=ranks, reduce="sum")
