"""ProcessMesh and placements: the value types of auto-parallel (numpy and the standard library only,
so the op table and PIR use them without importing the distributed layer).

A :class:`ProcessMesh` is an n-d array of ranks with a name per dim. A distributed tensor has one
placement per mesh dim, saying how its *global* value relates to the local shards of the ranks
along that mesh dim:

- ``Replicate()``: every rank holds the whole value;
- ``Shard(d)``: tensor dim ``d`` is cut into ``n`` contiguous chunks (``n`` = the mesh dim's size),
  sized as ``np.array_split`` does (the first ``N % n`` chunks one longer), and rank ``i`` holds
  chunk ``i``: uneven sizes are real shapes, never padding;
- ``Partial(op)``: the global value is the ``op``-reduction (sum, avg, max, min) of the locals.

A tensor dim sharded by several mesh dims is cut by the first of them, then each chunk by the next
(nested, in mesh-dim order). :func:`local_region` computes which slice of the global value a mesh
coordinate holds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

REDUCE_OPS = ("sum", "avg", "max", "min")


# ---- placements -------------------------------------------------------------------------------


class Placement:
    """Base class of Replicate, Shard and Partial (frozen value types)."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    @staticmethod
    def parse(text: str | Placement) -> Placement:
        """``"R"``, ``"S(0)"``, ``"P"`` / ``"P(avg)"`` (or a Placement, returned as is)."""
        if isinstance(text, Placement):
            return text
        m = _PLACEMENT_TEXT.fullmatch(str(text).replace(" ", ""))
        if m is None:
            raise ValueError(f"bad placement {text!r}: use R, S(dim) or P(sum|avg|max|min)")
        kind, arg = m.group(1), m.group(2)
        if kind in ("R", "Replicate"):
            if arg:
                raise ValueError(f"bad placement {text!r}: Replicate takes no argument")
            return Replicate()
        if kind in ("S", "Shard"):
            if not arg or not re.fullmatch(r"-?\d+", arg):
                raise ValueError(f"bad placement {text!r}: Shard needs a tensor dim, as in S(0)")
            return Shard(int(arg))
        return Partial(arg.strip("'\"") if arg else "sum")


_PLACEMENT_TEXT = re.compile(r"(R|S|P|Replicate|Shard|Partial)(?:\((.*)\))?")


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank along the mesh dim holds the whole value."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Tensor dim ``dim`` is split into contiguous chunks, one per rank along the mesh dim."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer)):
            raise TypeError(f"Shard needs an integer tensor dim, got {self.dim!r}")
        object.__setattr__(self, "dim", int(self.dim))

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard({self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """The global value is the ``reduce``-reduction of the ranks' local values along the mesh dim."""

    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCE_OPS:
            raise ValueError(f"Partial reduce must be one of {', '.join(REDUCE_OPS)}, got {self.reduce!r}")

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.reduce!r})"

    def __str__(self) -> str:
        return f"P({self.reduce})"


def format_placements(placements: Iterable[Placement]) -> str:
    """``[S(0), R]``."""
    return "[" + ", ".join(str(p) for p in placements) + "]"


# ---- the mesh ---------------------------------------------------------------------------------


class ProcessMesh:
    """An n-d array of ranks with one name per dim.

    ``ProcessMesh((2, 2), ["dp", "tp"])`` holds ranks 0..3 in row-major order;
    ``ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])`` (a nested list or a numpy array) gives the
    ranks themselves; ``ProcessMesh((2,), ["pp"], ranks=[4, 5])`` both. A flat list or tuple of
    ints is a shape. ``mesh["dp", 0]`` (or ``mesh[0]``) is the sub-mesh at index 0 of that dim.
    """

    __slots__ = ("_dim_names", "_hash", "_ranks")

    def __init__(
        self,
        shape_or_ranks: Any,
        dim_names: Sequence[str] | None = None,
        *,
        ranks: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        nested = isinstance(shape_or_ranks, np.ndarray) or (
            isinstance(shape_or_ranks, (list, tuple))
            and any(isinstance(x, (list, tuple, np.ndarray)) for x in shape_or_ranks)
        )
        if nested:
            if ranks is not None:
                raise ValueError("ProcessMesh: give the ranks either as the first argument or as ranks=")
            arr = np.array(shape_or_ranks)
        else:
            shape = tuple(shape_or_ranks) if isinstance(shape_or_ranks, (list, tuple)) else (shape_or_ranks,)
            if not shape or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) for d in shape):
                raise ValueError(
                    f"ProcessMesh: shape must be a non-empty list of ints, got {shape_or_ranks!r}"
                )
            if any(d < 1 for d in shape):
                raise ValueError(f"ProcessMesh: every mesh dim needs at least one rank, got shape {shape}")
            flat = np.arange(math.prod(shape)) if ranks is None else np.array(list(ranks))
            if flat.size != math.prod(shape):
                raise ValueError(f"ProcessMesh: {flat.size} ranks do not fill a mesh of shape {list(shape)}")
            arr = flat.reshape(shape)
        if arr.size == 0 or arr.dtype.kind not in "iu":
            raise ValueError(f"ProcessMesh: ranks must be a non-empty array of ints, got {shape_or_ranks!r}")
        if (arr < 0).any() or len(np.unique(arr)) != arr.size:
            raise ValueError(f"ProcessMesh: ranks must be distinct non-negative ints, got {arr.tolist()}")
        names = tuple(dim_names) if dim_names is not None else tuple(f"d{i}" for i in range(arr.ndim))
        if (
            len(names) != arr.ndim
            or len(set(names)) != len(names)
            or not all(isinstance(n, str) for n in names)
        ):
            raise ValueError(f"ProcessMesh: need {arr.ndim} distinct dim names, got {list(names)}")
        arr = arr.astype(np.int64)
        arr.setflags(write=False)
        self._ranks = arr
        self._dim_names = names
        self._hash = hash((arr.shape, tuple(arr.reshape(-1).tolist()), names))

    # ---- shape and ranks ---------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._ranks.shape)

    @property
    def ndim(self) -> int:
        return self._ranks.ndim

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self._dim_names

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of the mesh, in row-major order."""
        return tuple(int(r) for r in self._ranks.reshape(-1))

    @property
    def mesh(self) -> np.ndarray:
        """The ranks as a (read-only) array of the mesh's shape."""
        return self._ranks

    def dim(self, dim: int | str) -> int:
        """The index of a mesh dim given by name or (possibly negative) index."""
        if isinstance(dim, str):
            if dim not in self._dim_names:
                raise KeyError(f"mesh has no dim {dim!r}; its dims are {list(self._dim_names)}")
            return self._dim_names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"mesh dim {dim} is out of range for a {self.ndim}-d mesh")
        return dim % self.ndim

    def size(self, dim: int | str | None = None) -> int:
        """The number of ranks along ``dim`` (all ranks when None)."""
        return self._ranks.size if dim is None else self._ranks.shape[self.dim(dim)]

    def __contains__(self, rank: int) -> bool:
        return bool((self._ranks == rank).any())

    def coord(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of ``rank``."""
        hit = np.argwhere(self._ranks == rank)
        if not len(hit):
            raise ValueError(f"rank {rank} is not in {self}")
        return tuple(int(i) for i in hit[0])

    def group(self, rank: int, dim: int | str) -> tuple[int, ...]:
        """The ranks along mesh dim ``dim`` through ``rank`` (a collective's group), in order."""
        c = list(self.coord(rank))
        d = self.dim(dim)
        c[d] = slice(None)
        return tuple(int(r) for r in self._ranks[tuple(c)])

    def groups(self, dim: int | str) -> list[tuple[int, ...]]:
        """Every group along mesh dim ``dim``."""
        moved = np.moveaxis(self._ranks, self.dim(dim), -1)
        return [tuple(int(r) for r in g) for g in moved.reshape(-1, moved.shape[-1])]

    # ---- slicing -----------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> ProcessMesh:
        """``mesh["dp", 0]``: the sub-mesh at index 0 of dim "dp"; ``mesh[0]``, ``mesh[:, 1]``:
        numpy-style indexing (an integer drops its dim, a slice keeps it)."""
        if isinstance(index, tuple) and len(index) == 2 and isinstance(index[0], str):
            name, i = index
            full: list[Any] = [slice(None)] * self.ndim
            full[self.dim(name)] = i
            index = tuple(full)
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) > self.ndim:
            raise IndexError(f"too many indices ({len(idx)}) for a {self.ndim}-d mesh")
        kept = [
            n
            for n, i in zip(self._dim_names, idx + (slice(None),) * (self.ndim - len(idx)))
            if not isinstance(i, (int, np.integer))
        ]
        sub = self._ranks[idx]
        if sub.ndim == 0:
            return ProcessMesh((1,), [kept[0] if kept else self._dim_names[-1]], ranks=[int(sub)])
        if sub.size == 0:
            raise IndexError(f"index {index!r} selects no rank of {self}")
        return ProcessMesh(sub, kept)

    # ---- value semantics ---------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, ProcessMesh)
            and self._dim_names == other._dim_names
            and self._ranks.shape == other._ranks.shape
            and bool((self._ranks == other._ranks).all())
        )

    def __hash__(self) -> int:
        return self._hash

    @property
    def is_default_ranks(self) -> bool:
        """True when the ranks are 0..size-1 in row-major order."""
        return self.ranks == tuple(range(self.size()))

    def __repr__(self) -> str:
        ranks = "" if self.is_default_ranks else f", ranks={list(self.ranks)}"
        return f"ProcessMesh({list(self.shape)}, {list(self._dim_names)}{ranks})"


# ---- chunks and local regions -----------------------------------------------------------------


def chunk(size: int, n: int, i: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``i`` of ``n`` over ``size`` elements (``np.array_split`` sizes)."""
    q, r = divmod(size, n)
    start = i * q + min(i, r)
    return start, start + q + (i < r)


def chunk_sizes(size: int, n: int) -> tuple[int, ...]:
    q, r = divmod(size, n)
    return tuple(q + (i < r) for i in range(n))


def normalize(placements: Sequence[Placement | str], mesh: ProcessMesh, ndim: int) -> tuple[Placement, ...]:
    """Placements checked against a mesh and a tensor rank: one per mesh dim, shard dims within the
    rank (negative ones counted from the end); strings like ``"S(0)"`` are parsed."""
    ps = tuple(Placement.parse(p) for p in placements)
    problem = check(ps, mesh.ndim, ndim)
    if problem:
        raise ValueError(problem)
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in ps)


def check(placements: Sequence[Any], mesh_ndim: int, ndim: int) -> str | None:
    """What is wrong with ``placements`` for a ``mesh_ndim``-d mesh and a rank-``ndim`` tensor, or None."""
    if len(placements) != mesh_ndim:
        shown = format_placements(placements)
        return f"{len(placements)} placements {shown} for a {mesh_ndim}-d mesh (need one per mesh dim)"
    for p in placements:
        if not isinstance(p, Placement):
            return f"{p!r} is not a placement (use Replicate(), Shard(dim) or Partial(op))"
        if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
            return f"{p} shards dim {p.dim}, out of range for a rank-{ndim} tensor"
    ops = {p.reduce for p in placements if isinstance(p, Partial)}
    if len(ops) > 1 and not ops <= {"sum", "avg"}:  # sums and averages commute; max and sum do not
        return f"placements {format_placements(placements)} mix Partial reductions; reduce one first"
    return None


def local_region(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], coord: Sequence[int]
) -> tuple[slice, ...]:
    """The slice of the global value held at mesh coordinate ``coord`` (nested chunks per dim)."""
    start = [0] * len(shape)
    extent = list(shape)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            s, e = chunk(extent[p.dim], mesh_shape[m], coord[m])
            start[p.dim] += s
            extent[p.dim] = e - s
    return tuple(slice(s, s + e) for s, e in zip(start, extent))


def local_shape(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], coord: Sequence[int]
) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in local_region(shape, mesh_shape, placements, coord))
