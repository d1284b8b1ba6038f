"""``DistArray``: the payload of a distributed tensor.

It holds the global shape and dtype, the mesh and one placement per mesh dim, and the local shards
of the ranks this process hosts (every rank of the mesh under ``sim``, its own under ``mpi``), so a
Tensor whose payload is a DistArray has the global shape, and every computation on it is written
once as "for each hosted rank".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import backend as B
from ..placement import Placement, ProcessMesh, format_placements, local_region, normalize
from .comm import get_backend


class DistArray:
    """Global ``shape``/``dtype``, ``mesh``, ``placements`` and ``shards`` (rank -> local array)."""

    __slots__ = ("dtype", "mesh", "placements", "shape", "shards")

    def __init__(
        self,
        shards: Mapping[int, Any],
        mesh: ProcessMesh,
        placements: Sequence[Placement],
        shape: Sequence[int],
        dtype: Any,
    ) -> None:
        self.mesh = mesh
        self.shape = tuple(int(d) for d in shape)
        self.placements = normalize(placements, mesh, len(self.shape))
        self.dtype = B.dtype(dtype)
        self.shards = dict(shards)

    # ---- array-like metadata (what Tensor reads) -----------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def device(self) -> str:
        for a in self.shards.values():
            return B.device_of(a)
        return "cpu"

    # ---- layout ------------------------------------------------------------------------------
    def region(self, rank: int) -> tuple[slice, ...]:
        """The slice of the global value that ``rank``'s shard covers (its Partial dims aside)."""
        return local_region(self.shape, self.mesh.shape, self.placements, self.mesh.coord(rank))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.region(rank))

    def local(self) -> Any:
        """This rank's shard (under ``sim`` outside a per-rank thread, use ``local_shards``)."""
        hosted = get_backend().hosted(self.mesh.ranks)
        if len(hosted) != 1:
            if not hosted:
                raise ValueError(
                    f"this process hosts no rank of {self.mesh}: it holds no shard of this tensor"
                )
            raise ValueError(
                f"this process hosts {len(hosted)} ranks of {self.mesh} (the sim backend): "
                "use dist.local_shards(t) for every rank's shard"
            )
        return self.shards[hosted[0]]

    def check(self) -> None:
        """Every hosted shard has the shape and dtype its placements give (a bug guard for tests)."""
        want = get_backend().hosted(self.mesh.ranks)
        if sorted(self.shards) != sorted(want):
            raise AssertionError(f"shards of ranks {sorted(self.shards)}, expected the hosted {sorted(want)}")
        for r, a in self.shards.items():
            if tuple(a.shape) != self.local_shape(r) or a.dtype != self.dtype:
                raise AssertionError(
                    f"rank {r}: shard {list(a.shape)} {a.dtype}, "
                    f"expected {list(self.local_shape(r))} {self.dtype}"
                )

    def with_shards(
        self, shards: Mapping[int, Any], placements: Sequence[Placement] | None = None
    ) -> DistArray:
        return DistArray(
            shards, self.mesh, self.placements if placements is None else placements, self.shape, self.dtype
        )

    def __repr__(self) -> str:
        return (
            f"DistArray({list(self.shape)} {B.dtype_name(self.dtype)}, {self.mesh!r}, "
            f"{format_placements(self.placements)})"
        )


def local(t: Any, rank: int) -> Any:
    """``rank``'s array of tensor ``t``: its shard if distributed, else the whole array."""
    x = t._data
    return x.shards[rank] if isinstance(x, DistArray) else x


def held_bytes(rank: int, tensors: Iterable[Any]) -> int:
    """The bytes ``rank`` holds of ``tensors`` (Tensors; None skipped): its shard of a distributed
    one, a plain one whole."""
    return sum(local(t, rank).nbytes for t in tensors if t is not None)
