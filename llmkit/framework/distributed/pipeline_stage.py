"""How one pipeline stage runs its jobs: eagerly, or as static programs (``RUNNERS``).

Both take the same calls from :class:`~.pipeline.RankPipeline`: ``forward(x, target)`` returns
the stage's output (the activation to send, or on the last stage the micro-batch's loss over
``m``) and the state a micro-batch holds until its backward; ``backward(state, g, split)`` returns
the input's gradient (None on the first stage) and what the weight-gradient job needs;
``weight(pending)`` finishes the weight gradients. Parameter gradients accumulate in ``.grad``.

- :class:`EagerStage` runs the pieces with autograd; the state is the autograd graph, and a split
  backward leaves the weight gradients to ``accumulate_deferred``.
- :class:`StaticStage` traces the stage's forward and backward once as one function (input and
  output gradient in; output, input gradient and weight gradients out), takes this rank's program
  of it (partitioned when the stage's tensors are distributed), and splits it
  (``jit.split_phases``) into the programs of the F, B and W jobs, each compiled; the state is the
  residual arrays (saved activations) F hands to B and W.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..autograd import accumulate_deferred, grad, run_backward
from ..dispatch import O
from ..jit import to_static
from ..jit.compile import executor_for
from ..jit.split import split_phases
from ..nn import Layer
from ..tape import enable_grad, no_grad
from ..tensor import Tensor
from .api import from_local, reshard
from .dist_array import DistArray, local

if TYPE_CHECKING:
    from .pipeline import RankPipeline


class EagerStage:
    """A stage's jobs with autograd."""

    def __init__(self, rp: RankPipeline, stage: int) -> None:
        self.rp, self.stage = rp, stage
        self.pieces = rp.pipe.pieces(stage)
        self.last = stage == rp.pipe.schedule.stages - 1

    def run(self, x: Tensor, target: Tensor | None) -> Tensor:
        h, last = x, self.rp.pipe.parts.last
        for p in self.pieces:
            h = p.run(self.rp.named, h, target) if p is last else p.run(self.rp.named, h)
        return h / float(self.rp.pipe.schedule.micro_batches) if self.last else h

    def forward(self, x: Tensor, target: Tensor | None) -> tuple[Tensor, Any]:
        with enable_grad():
            y = self.run(x, target)
        return y, (x if x.requires_grad else None, y)

    def backward(self, state: Any, g: Tensor | None, split: bool) -> tuple[Tensor | None, Any]:
        x, y = state
        if g is None:
            with no_grad():
                g = O.ones_like(y)
        params = self.rp.params
        pending = run_backward([y], [g], defer=(lambda t: id(t) in params) if split else None)
        return (x.grad if x is not None else None), pending

    def weight(self, pending: Any) -> None:
        accumulate_deferred(pending)


class StaticStage(EagerStage):
    """A stage's jobs as the split programs of its traced forward and backward."""

    def __init__(self, rp: RankPipeline, stage: int) -> None:
        super().__init__(rp, stage)
        self.first = stage == 0
        self.phases: list | None = None

    # ---- building (at the first forward: the shapes are known) ---------------------------------------
    def _build(self, x: Tensor, target: Tensor | None) -> None:
        rp = self.rp
        ps, mesh = rp.layout.batch_placements, rp.stage_mesh
        layers = [rp.named[n] for n in dict.fromkeys(n for p in self.pieces for n in p.layers)]
        params = (p for m in layers if isinstance(m, Layer) for p in m.parameters())
        self.params = list({id(p): p for p in params}.values())

        def joint(x, z):
            y = self.run(x, z if self.last else None)
            if ps is not None and not self.last:
                y = reshard(y, mesh, ps)  # the layout the next stage receives
            seed = O.ones_like(y) if self.last else z
            wrt = ([] if self.first else [x]) + self.params
            return (y, *grad([y], wrt, [seed]))

        if self.last:
            z = target
        else:  # a stand-in output gradient: the boundary's shape and layout
            meta = rp.boundary
            shape = rp.local_boundary_shape()
            zero = np.zeros(shape, meta.dtype)
            z = Tensor(zero) if ps is None else from_local({rp.rank: zero}, mesh, ps, meta.shape)
        cp = to_static(joint, compiler="none").get_concrete_program(x, z)
        if cp.updated:
            raise RuntimeError("a pipeline stage's step rebinds state; it must only compute")
        runner = cp.runner  # a DistRunner for distributed stages, else None
        program = cp.program if runner is None else runner.rank_program(rp.rank)
        n = 1 + (not self.first)  # y, then dx
        grads = list(range(n, n + len(self.params)))
        b_out = [1] if not self.first else []
        phases = [[0], b_out, grads] if rp.pipe.schedule.split_backward else [[0], b_out + grads]
        split = split_phases(program, phases)
        self.phases = [(executor_for(p.program, rp.compiler), p.inputs, p.outputs) for p in split]
        self.captures = cp.captures
        if runner is None:
            self.metas: list[tuple[Any, Any]] = [(v.type, None) for v in program.function().outputs]
        else:
            self.metas = runner.outputs

    # ---- running --------------------------------------------------------------------------------------
    def _run(self, k: int, args: dict[int, Any], res: dict[int, Any]) -> dict[int, Any]:
        ex, ins, outs = self.phases[k]
        rank = self.rp.rank
        n_args = 2

        def value(kind: str, i: int) -> Any:
            if kind == "res":
                return res[i]
            return args[i] if i < n_args else local(self.captures[i - n_args], rank)

        got = ex.run([value(kind, i) for kind, i in ins])
        result = {}
        for (kind, i), a in zip(outs, got):
            if kind == "res":
                res[i] = a
            else:
                result[i] = a
        return result

    def _wrap(self, i: int, a: Any) -> Tensor:
        t, ps = self.metas[i]
        if ps is None:
            return Tensor(a)
        rp = self.rp
        return Tensor(DistArray({rp.rank: a}, rp.stage_mesh, ps, t.shape, t.dtype))

    def _accumulate(self, outs: dict[int, Any]) -> None:
        n = 1 + (not self.first)
        with no_grad():
            for k, p in enumerate(self.params):
                if n + k in outs:
                    g = self._wrap(n + k, outs[n + k])
                    p.grad = g if p.grad is None else p.grad + g

    def forward(self, x: Tensor, target: Tensor | None) -> tuple[Tensor, Any]:
        if self.phases is None:
            self._build(x, target)
        rank = self.rp.rank
        args = {0: local(x, rank)}
        if self.last:
            args[1] = local(target, rank)
        res: dict[int, Any] = {}
        out = self._run(0, args, res)
        return self._wrap(0, out[0]), (args, res)

    def backward(self, state: Any, g: Tensor | None, split: bool) -> tuple[Tensor | None, Any]:
        args, res = state
        if g is not None:
            args[1] = local(g, self.rp.rank)
        outs = self._run(1, args, res)
        if not split:
            self._accumulate(outs)
        return (None if self.first else self._wrap(1, outs[1])), state

    def weight(self, pending: Any) -> None:
        args, res = pending
        self._accumulate(self._run(2, args, res))


RUNNERS = {"eager": EagerStage, "static": StaticStage}
