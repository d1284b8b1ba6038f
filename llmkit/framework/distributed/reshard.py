"""Reshard: move a distributed value from one layout to another, one mesh dim at a time.

Each step changes the placement of one mesh dim with one collective over the groups along it:

=============  ===================  ======================================================
step           collective           what each rank does
=============  ===================  ======================================================
R -> S(d)      none                 keeps its chunk of dim d
S(d) -> R      all_gather           concatenates the group's chunks of dim d
P -> R         all_reduce           reduces the group's values
P -> S(d)      reduce_scatter       reduces, keeping its chunk of dim d
S(d) -> S(e)   all_to_all           cuts dim e into chunks, trades them for the chunks of d
R -> P(op)     none                 sum: rank 0 of the group keeps the value, the others zeros;
                                    avg, max, min: every rank keeps it
=============  ===================  ======================================================

A step on mesh dim m that shards or unshards tensor dim d is direct only when no later mesh dim
shards d too (chunks nest in mesh-dim order); :func:`plan` orders the steps so that holds, cheap
ones first (slicing shrinks what later steps move; gathers come last) unless a step would block a
change still due at an earlier mesh dim, and when every step is blocked it gathers the later mesh
dims first. Anything else (S -> P, P(a) -> P(b)) goes through R. Values
move between meshes (:func:`move`) with sends and receives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import backend as B
from ..ops.collective import run_collective
from ..placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    chunk,
    chunk_sizes,
    format_placements,
    local_region,
)
from .comm import get_backend
from .dist_array import DistArray

SLICE, ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ALL_TO_ALL, TO_PARTIAL = (
    "slice",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "to_partial",
)


@dataclass(frozen=True)
class Step:
    """Change mesh dim ``dim`` from placement ``src`` to ``dst`` (one collective, or none)."""

    dim: int
    src: Placement
    dst: Placement

    @property
    def kind(self) -> str:
        s, d = self.src, self.dst
        if isinstance(s, Replicate):
            return SLICE if isinstance(d, Shard) else TO_PARTIAL
        if isinstance(s, Partial):
            return ALL_REDUCE if isinstance(d, Replicate) else REDUCE_SCATTER
        return ALL_GATHER if isinstance(d, Replicate) else ALL_TO_ALL

    def __str__(self) -> str:
        return f"{self.kind}(mesh dim {self.dim}: {self.src} -> {self.dst})"


def _direct(src: Placement, dst: Placement) -> bool:
    if isinstance(dst, Partial):
        return isinstance(src, Replicate)
    return not (isinstance(src, Partial) and isinstance(dst, Partial))


# Cheaper first: slicing shrinks everything after it; gathers grow what later steps move.
_PRIORITY = {SLICE: 0, REDUCE_SCATTER: 1, ALL_REDUCE: 2, ALL_TO_ALL: 3, ALL_GATHER: 4, TO_PARTIAL: 5}


def plan(src: Sequence[Placement], dst: Sequence[Placement]) -> list[Step]:
    """The steps from placements ``src`` to ``dst`` on one mesh."""
    cur = list(src)
    dst = list(dst)
    steps: list[Step] = []

    def blockers(i: int, a: Placement, b: Placement) -> list[int]:
        dims = {p.dim for p in (a, b) if isinstance(p, Shard)}
        return [j for j in range(i + 1, len(cur)) if isinstance(cur[j], Shard) and cur[j].dim in dims]

    def blocks(i: int, to: Placement) -> bool:
        """Sharding at mesh dim i would block a change still due at an earlier mesh dim."""
        return isinstance(to, Shard) and any(
            cur[k] != dst[k] and to.dim in {p.dim for p in (cur[k], dst[k]) if isinstance(p, Shard)}
            for k in range(i)
        )

    def take(i: int, to: Placement) -> None:
        steps.append(Step(i, cur[i], to))
        cur[i] = to

    while cur != dst:
        best = None
        for i, (a, b) in enumerate(zip(cur, dst)):
            if a == b:
                continue
            to = b if _direct(a, b) else Replicate()
            if blockers(i, a, to):
                continue
            kind = Step(i, a, to).kind
            order = -i if kind == ALL_GATHER else i  # gather the innermost first, shard the outermost
            key = (blocks(i, to), _PRIORITY[kind], order)
            if best is None or key < best[0]:
                best = (key, i, to)
        if best is not None:
            take(best[1], best[2])
            continue
        # Every remaining change is blocked by later mesh dims sharding the same tensor dim:
        # gather those, then make the change (they are re-sharded by later steps).
        i = max(k for k in range(len(cur)) if cur[k] != dst[k])
        to = dst[i] if _direct(cur[i], dst[i]) else Replicate()
        for j in sorted(blockers(i, cur[i], to), reverse=True):
            take(j, Replicate())
        take(i, to)
    return steps


# ---- one step at one rank: the op that does it -------------------------------------------------------


def step_op(step: Step, shape: Sequence[int], mesh: Any, placements: Sequence[Placement], rank: int) -> tuple:
    """``(op name, attributes)`` doing ``step`` at ``rank`` on its local array: ``slice`` or
    ``zeros_like`` locally, or a collective op of ``ops/collective.py`` over the group along the
    step's mesh dim; ``(None, {})`` when the rank keeps its array. Eager reshards run these with the
    communicator; the partition pass emits them as ops of the per-rank program. Over a mesh dim
    of one rank every step keeps the array."""
    m, kind = step.dim, step.kind
    group = mesh.group(rank, m)
    n, i = len(group), group.index(rank)
    if n == 1:
        return None, {}  # one rank along this mesh dim: every layout of it is the whole value
    coord = mesh.coord(rank)
    region = local_region(shape, mesh.shape, placements, coord)
    parent = list(placements)
    parent[m] = Replicate()
    whole = local_region(shape, mesh.shape, parent, coord)  # what the group shares, per tensor dim

    def extent(d: int, r: tuple = whole) -> int:
        return r[d].stop - r[d].start

    if kind == SLICE:
        s, e = chunk(extent(step.dst.dim), n, i)
        return "slice", {"axes": [step.dst.dim], "starts": [s], "ends": [e]}
    if kind == TO_PARTIAL:
        return ("zeros_like", {}) if step.dst.reduce == "sum" and i else (None, {})
    common = {"group": group, "mesh": mesh}
    if kind == ALL_REDUCE:
        return "all_reduce", {**common, "reduce": step.src.reduce}
    if kind == ALL_GATHER:
        d = step.src.dim
        return "all_gather", {**common, "axis": d, "sizes": chunk_sizes(extent(d), n)}
    if kind == REDUCE_SCATTER:
        d = step.dst.dim
        return "reduce_scatter", {
            **common,
            "axis": d,
            "sizes": chunk_sizes(extent(d), n),
            "rank": rank,
            "reduce": step.src.reduce,
        }
    d, e = step.src.dim, step.dst.dim  # ALL_TO_ALL
    return "all_to_all", {
        **common,
        "split_axis": e,
        "split_sizes": chunk_sizes(extent(e, region), n),
        "concat_axis": d,
        "concat_sizes": chunk_sizes(extent(d), n),
        "rank": rank,
    }


def apply_step(x: DistArray, step: Step, what: str = "reshard") -> DistArray:
    """Run one step on the hosted shards of ``x``."""
    comm = get_backend()
    new_placements = list(x.placements)
    new_placements[step.dim] = step.dst
    label = (
        f"{step.kind} for {what} {format_placements(x.placements)} -> {format_placements(new_placements)} "
        f"over mesh dim {x.mesh.dim_names[step.dim]!r} of {x.mesh!r}"
    )
    out = dict(x.shards)
    for group in x.mesh.groups(step.dim):
        hosted = comm.hosted(group)
        if not hosted:
            continue
        op, a = step_op(step, x.shape, x.mesh, x.placements, hosted[0])
        if op in ("slice", "zeros_like", None):
            for r in hosted:
                op, a = step_op(step, x.shape, x.mesh, x.placements, r)
                local = x.shards[r]
                if op == "slice":
                    idx = [slice(None)] * local.ndim
                    idx[a["axes"][0]] = slice(a["starts"][0], a["ends"][0])
                    local = local[tuple(idx)]
                elif op == "zeros_like":
                    local = B.xp_of(local).zeros_like(local)
                out[r] = local
        else:
            out.update(run_collective(comm, op, group, {r: x.shards[r] for r in hosted}, a, label))
    return x.with_shards(out, new_placements)


def reshard_array(x: DistArray, placements: Sequence[Placement], what: str = "reshard") -> DistArray:
    """``x`` with new placements on its mesh."""
    for step in plan(x.placements, placements):
        x = apply_step(x, step, what)
    return x


# ---- between meshes ---------------------------------------------------------------------------


def move(x: DistArray, mesh: Any, placements: Sequence[Placement], what: str = "reshard") -> DistArray:
    """``x`` placed on another mesh. Meshes of one shape: reshard on the source, then rank i of the
    source sends its shard to rank i of the target. Otherwise the source is replicated and every
    target rank receives just its region from one source rank (spread over the source ranks)."""
    from ..placement import normalize

    placements = normalize(placements, mesh, x.ndim)
    comm = get_backend()
    if mesh.shape == x.mesh.shape:
        y = reshard_array(x, placements, what)
        moves = [(s, t, y.shards.get(s), y.local_shape(s), y.dtype) for s, t in zip(y.mesh.ranks, mesh.ranks)]
        got = comm.send_recv(moves, what=f"send/recv for {what} to {mesh!r}")
        return DistArray({t: a for (_, t), a in got.items()}, mesh, placements, x.shape, x.dtype)
    full = reshard_array(x, [Replicate()] * x.mesh.ndim, what)
    # partial target dims: move the value as replicated there, then keep it on one rank (exact)
    dense = [Replicate() if isinstance(p, Partial) else p for p in placements]
    target = DistArray({}, mesh, dense, x.shape, x.dtype)
    moves = []
    sources = x.mesh.ranks
    for k, t in enumerate(mesh.ranks):
        s = sources[k % len(sources)]
        region = target.region(t)
        local = full.shards[s][region] if s in full.shards else None
        moves.append((s, t, local, target.local_shape(t), x.dtype))
    got = comm.send_recv(moves, what=f"send/recv for {what} to {mesh!r}")
    y = DistArray({t: a for (_, t), a in got.items()}, mesh, dense, x.shape, x.dtype)
    return reshard_array(y, placements, what)
