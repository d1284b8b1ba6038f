"""The user-facing functions: place a global value on a mesh, change its placements, get it back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import backend as B
from ..dispatch import apply
from ..placement import Partial, Placement, ProcessMesh, Replicate, normalize
from ..tensor import Parameter, Tensor
from .comm import get_backend
from .dist_array import DistArray
from .reshard import reshard_array


def _check_mesh(mesh: ProcessMesh) -> None:
    world = get_backend().world_size
    bad = [r for r in mesh.ranks if r >= world]
    if bad:
        raise ValueError(f"{mesh!r} uses ranks {bad} outside the world of {world} ranks")


def _wrap(like: Any, payload: Any) -> Tensor:
    if isinstance(like, Parameter):
        return Parameter(payload, trainable=like.requires_grad, name=like.name)
    t = Tensor(payload, requires_grad=isinstance(like, Tensor) and like.requires_grad)
    if isinstance(like, Tensor):
        t.name = like.name
    return t


def distribute(value: Any, mesh: ProcessMesh, placements: Sequence[Placement | str]) -> DistArray:
    """The DistArray of a global array (every process passes the same value)."""
    _check_mesh(mesh)
    ps = normalize(placements, mesh, value.ndim)
    full = DistArray({}, mesh, [Replicate()] * mesh.ndim, value.shape, value.dtype)
    full.shards = {r: value for r in get_backend().hosted(mesh.ranks)}
    dense = [Replicate() if isinstance(p, Partial) else p for p in ps]
    out = reshard_array(full, dense, "shard_tensor")
    out = reshard_array(out, ps, "shard_tensor")  # R -> P: no communication
    # slices of the caller's array: copy, so shards never alias the input or each other
    return out.with_shards({r: a.copy() for r, a in out.shards.items()})


def shard_tensor(data: Any, mesh: ProcessMesh, placements: Sequence[Placement | str]) -> Tensor:
    """A distributed tensor from its global value ``data`` (a Tensor, array or nested list, the
    same on every process). A Parameter stays a Parameter (same name, same trainability). Inside
    ``to_static``, it places the traced value (a ``dist.reshard`` op)."""
    if isinstance(data, Tensor) and not data.is_concrete:
        if isinstance(data._data, DistArray):
            raise TypeError(
                "shard_tensor takes a global value; to move a distributed tensor use dist.reshard"
            )
        return reshard(data, mesh, placements)
    value = data.numpy() if isinstance(data, Tensor) else np.asarray(data)
    if not isinstance(data, Tensor) and value.dtype == np.float64 and not isinstance(data, np.ndarray):
        value = value.astype(B.get_default_dtype())
    return _wrap(data, distribute(value, mesh, placements))


def from_local(
    shards: Any, mesh: ProcessMesh, placements: Sequence[Placement | str], shape: Sequence[int] | None = None
) -> Tensor:
    """A distributed tensor from local shards: ``{rank: array}`` for the hosted ranks (or this rank's
    array). ``shape`` (the global shape) is needed when a split may be uneven; without it the shards
    are taken as even chunks."""
    _check_mesh(mesh)
    hosted = get_backend().hosted(mesh.ranks)
    if not isinstance(shards, Mapping):
        if len(hosted) != 1:
            raise ValueError(f"from_local: this process hosts ranks {hosted}: pass {{rank: array}}")
        shards = {hosted[0]: shards}
    shards = {r: B.xp_of(a).asarray(a) if B.is_array(a) else np.asarray(a) for r, a in shards.items()}
    if sorted(shards) != sorted(hosted):
        raise ValueError(
            f"from_local: got shards of ranks {sorted(shards)}, this process hosts {sorted(hosted)}"
        )
    some = next(iter(shards.values()))
    ps = normalize(placements, mesh, some.ndim)
    if shape is None:
        full = list(some.shape)
        for m, p in enumerate(ps):
            if p.is_shard():
                full[p.dim] *= mesh.shape[m]
        shape = full
    x = DistArray(shards, mesh, ps, shape, some.dtype)
    x.check()
    return Tensor(x)


def _payload(t: Tensor, fn: str) -> DistArray:
    if not isinstance(t, Tensor) or not isinstance(t._data, DistArray):
        raise TypeError(
            f"{fn} takes a distributed tensor (made by dist.shard_tensor), got {type(t).__name__}"
        )
    return t._data


def reshard(t: Tensor, mesh: ProcessMesh, placements: Sequence[Placement | str]) -> Tensor:
    """``t`` with new placements, on ``mesh`` (the same or another mesh); differentiable (the
    gradient comes back unchanged: a layout is not a computation) and traceable."""
    if not isinstance(t, Tensor) or t.is_concrete:
        raise TypeError(
            f"reshard takes a distributed tensor, got {type(t).__name__}: "
            "place a global value with shard_tensor"
        )
    _check_mesh(mesh)
    return apply("reshard", t, mesh=mesh, placements=normalize(placements, mesh, t.ndim))


def unshard(t: Tensor) -> Tensor:
    """The global value as an ordinary Tensor, on every process (collective: every rank calls it)."""
    x = _payload(t, "unshard")
    full = reshard_array(x, [Replicate()] * x.mesh.ndim, "unshard")
    comm = get_backend()
    hosted = comm.hosted(x.mesh.ranks)
    outside = [r for r in range(comm.world_size) if r not in x.mesh]
    got = {}
    if outside and not (hosted and len(comm.hosted(outside)) == len(outside)):
        # processes outside the mesh (MPI) receive the value from the mesh's first rank
        src = x.mesh.ranks[0]
        moves = [(src, r, full.shards.get(src), x.shape, x.dtype) for r in outside]
        got = comm.send_recv(moves, what=f"unshard from {x.mesh!r}")
    return Tensor(full.shards[hosted[0]] if hosted else got[(x.mesh.ranks[0], comm.rank)])


def local_shards(t: Tensor) -> dict[int, Tensor]:
    """Every hosted rank's shard: all ranks of the mesh under ``sim``, this rank's under ``mpi``."""
    x = _payload(t, "local_shards")
    return {r: Tensor(a) for r, a in sorted(x.shards.items())}
