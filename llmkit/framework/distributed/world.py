"""The distributed world: how ops run on distributed tensors (registered with dispatch for DistArray).

For an op on distributed inputs (all on one mesh; plain arrays among them count as replicated):
its SPMD rule picks the placements (``ops.spmd.decide``), the inputs are resharded to them, and the
op runs on each hosted rank's shards, with its kernel (an output-shape attribute made the rank's
local shape) or the rule's local implementation. A rule may instead ask for the op's decomposition,
which then runs on the distributed tensors op by op. ``reshard`` itself moves the data. Autograd
records the op as in every world, so gradients are distributed tensors too: a replicated
parameter's gradient stays ``Partial`` until something needs it reduced.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend as B
from ..autograd import no_grad
from ..dispatch import EAGER, World, register_world
from ..ops.spmd import RESHARD, RESHARD_LIKE, decide, dense, local_attrs
from ..opspec import Meta, OpError, OpSpec
from ..placement import Replicate, format_placements
from ..tensor import Parameter, Tensor
from .comm import get_backend
from .dist_array import DistArray
from .reshard import move, reshard_array


def lift(p: Any, mesh: Any) -> DistArray:
    """A payload as a DistArray on ``mesh``: a plain array is replicated."""
    if isinstance(p, DistArray):
        return p
    a = p if B.is_array(p) else np.asarray(p)
    hosted = get_backend().hosted(mesh.ranks)
    return DistArray({r: a for r in hosted}, mesh, [Replicate()] * mesh.ndim, a.shape, a.dtype)


class DistWorld(World):
    """Runs ops on DistArray payloads, one hosted rank at a time."""

    name = "distributed"

    def run(self, spec: OpSpec, payloads: list[Any], attrs: dict[str, Any], inputs: tuple = ()) -> Any:
        if spec.spmd is RESHARD_LIKE:  # the gradient of a move between meshes moves back
            x, like = payloads
            if isinstance(x, DistArray) and isinstance(like, DistArray) and x.mesh != like.mesh:
                return move(x, like.mesh, dense(like.placements), "reshard's gradient")
        meshes = list(dict.fromkeys(p.mesh for p in payloads if isinstance(p, DistArray)))
        if len(meshes) > 1:
            raise OpError(
                f"{spec.name}: inputs on different meshes ({meshes[0]!r} and {meshes[1]!r}); "
                "dist.reshard one of them onto the other's mesh first"
            )
        mesh = meshes[0]
        xs = [lift(p, mesh) for p in payloads]
        if spec.spmd is RESHARD:
            x, target, ps = xs[0], attrs["mesh"], attrs["placements"]
            return reshard_array(x, ps) if target == x.mesh else move(x, target, ps)
        metas = [Meta(x.shape, x.dtype) for x in xs]
        out_metas = spec.infer_meta(*metas, **attrs)  # one clear error for bad input, before any move
        fixed = [i for i, t in enumerate(inputs) if isinstance(t, Parameter)]
        d = decide(spec, metas, [x.placements for x in xs], attrs, mesh.shape, fixed=fixed)
        if d.decompose:
            with no_grad():
                out = spec.decompose(*[Tensor._wrap(x) for x in xs], **attrs)
            if spec.multi_output:
                return tuple(lift(o._data, mesh) for o in out)
            return lift(out._data, mesh)
        xs = [
            x if want is None or want == x.placements else reshard_array(x, want, f"{spec.name}'s input")
            for x, want in zip(xs, d.inputs)
        ]
        out_metas = tuple(out_metas) if spec.multi_output else (out_metas,)
        rule = spec.spmd
        outs: list[dict[int, Any]] = [{} for _ in out_metas]
        for r in get_backend().hosted(mesh.ranks):
            coord = mesh.coord(r)
            here = local_attrs(spec, attrs, metas, out_metas[0], d.outputs[0], mesh.shape, coord)
            arrays = [
                np.broadcast_to(np.zeros((), x.dtype), x.shape) if i in rule.shape_only else x.shards[r]
                for i, x in enumerate(xs)
            ]
            if d.local is not None:
                regions = [x.region(r) for x in xs]
                with no_grad():
                    res = d.local(regions, *[Tensor._wrap(a) for a in arrays], **attrs)
                res = tuple(t._data for t in res) if spec.multi_output else res._data
            else:
                res = EAGER.run(spec, arrays, here)
            for k, a in enumerate(res if spec.multi_output else (res,)):
                outs[k][r] = a
        made = tuple(
            DistArray(shards, mesh, ps, m.shape, m.dtype) for shards, ps, m in zip(outs, d.outputs, out_metas)
        )
        return made if spec.multi_output else made[0]

    def constant(self, value: Any, dtype: np.dtype, like: Any = None) -> Any:
        return np.asarray(value, dtype=dtype)  # replicated when an op lifts it

    def concrete_error(self, what: str, tensor: Any) -> Exception:
        x = tensor._data
        return TypeError(
            f"{what} needs concrete values, and this is a distributed tensor ({list(x.shape)} on "
            f"{x.mesh!r} as {format_placements(x.placements)}): dist.unshard(t) gives the global value "
            "(every rank must call it), t.local() this rank's shard"
        )


DIST = DistWorld()
register_world(DistArray, DIST)
