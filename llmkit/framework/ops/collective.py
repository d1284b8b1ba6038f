"""Collectives: communication between ranks (kind ``collective``: the ``dist`` dialect, fusion barriers).

``reshard(x, mesh, placements)`` is the global view: the value stays the same and takes the layout
``placements`` on ``mesh`` (the distributed world moves the shards; on plain tensors it is the
identity). Its gradient is the same value too (a layout is not a computation), laid out as the input
was: ``reshard_like(g, x)``, with a Partial placement of x's made Replicate. So the backward of the
plan's reshards is Megatron's: the gradient of a row-parallel product's all-reduced output reaches
the product replicated (one all-reduce of the activation's gradient, never a weight moved), that of
a sequence-parallel reduce-scatter is all-gathered, that of an all-gather reduce-scattered.

The others act on the local arrays of a per-rank program (what the auto-parallel partition pass
emits) over ``group``, the ranks taking part, in order; ``mesh`` only names where they come from in
errors. Their kernels reach the process's communicator through :func:`register_communicator`
(the op layer never imports the distributed layer), so the executor runs them like any op:

- ``all_reduce``: every member gets the reduction (sum, avg, max, min) of the members' arrays;
- ``all_gather``: the members' arrays concatenated along ``axis`` (member i holds ``sizes[i]``);
- ``reduce_scatter``: the reduction, cut along ``axis`` into ``sizes``; member i keeps piece i;
- ``all_to_all``: member i cuts its array along ``split_axis`` into ``split_sizes``, sends piece j
  to member j, and concatenates what it gets along ``concat_axis`` (member j sends
  ``concat_sizes[j]``);
- ``send`` / ``recv``: point to point with ``peer`` (``send`` returns its input, so it can be
  ordered; it does not wait for the receiver).

``rank`` (the rank that runs the op) fixes the local result shape where it depends on the member.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..dispatch import O
from ..opspec import A, Kind, Meta, OpError, attr, defop, optional
from ..placement import check
from . import spmd as P

REDUCE = ("sum", "avg", "max", "min")
_COMMUNICATOR: list[Callable[[], Any]] = []


def register_communicator(get: Callable[[], Any]) -> None:
    """Give collective kernels the process's communicator (the distributed layer calls this)."""
    _COMMUNICATOR[:] = [get]


def _communicator(name: str) -> Any:
    if not _COMMUNICATOR:
        raise OpError(f"{name}: no communicator; import llmkit.framework.distributed first")
    return _COMMUNICATOR[0]()


def _comm(name: str, group: tuple, mesh: Any) -> tuple[Any, int, str]:
    comm = _communicator(name)
    rank = comm.rank
    where = f"dist.{name} over ranks {list(group)}" + (f" of {mesh!r}" if mesh is not None else "")
    if rank not in group:
        raise OpError(
            f"{where}: this process runs rank {rank}, not a member (under sim, run a per-rank program "
            "on its rank's thread with dist.run_ranks)"
        )
    return comm, rank, where


def run_collective(comm: Any, name: str, group: tuple, xs: dict, a: dict, what: str) -> dict:
    """The per-rank collective op ``name`` with attributes ``a`` on ``xs`` ({rank: array} for the
    hosted members of ``group``) through ``comm``: what the ops' kernels and eager reshards run."""
    nd = next(iter(xs.values())).ndim  # (negative axes count from the end)
    if name == "all_reduce":
        return comm.all_reduce(group, xs, a["reduce"], what=what)
    if name == "all_gather":
        return comm.all_gather(group, xs, a["axis"] % nd, a["sizes"], what=what)
    if name == "reduce_scatter":
        return comm.reduce_scatter(group, xs, a["axis"] % nd, a["sizes"], a["reduce"], what=what)
    sa, ca = a["split_axis"] % nd, a["concat_axis"] % nd
    return comm.all_to_all(group, xs, sa, a["split_sizes"], ca, a["concat_sizes"], what=what)


def _kernel(name: str) -> Callable[..., Any]:
    """The kernel of collective ``name``: this process's rank's share of it."""

    def kernel(xp, x, **attrs):
        comm, rank, where = _comm(name, attrs["group"], attrs["mesh"])
        return run_collective(comm, name, attrs["group"], {rank: x}, attrs, where)[rank]

    return kernel


_PER_RANK = P.not_distributed(
    "a per-rank collective acts on one rank's local array in a per-rank program; "
    "to move a distributed tensor use dist.reshard"
)


def _reduce_attr():
    return attr("reduce", A.STR, "sum", lambda v: None if v in REDUCE else f"use one of {', '.join(REDUCE)}")


def _group():
    return attr("group", A.INTS, check=_distinct)


def _mesh():
    return attr("mesh", optional(A.MESH), None)


def _distinct(g: tuple) -> str | None:
    return None if g and len(set(g)) == len(g) else "a non-empty list of distinct ranks"


def _member(name: str, group: tuple, rank: int) -> int:
    if rank not in group:
        raise OpError(f"{name}: rank {rank} is not in group {list(group)}")
    return group.index(rank)


def _axis_meta(name: str, x, axis: int, sizes: tuple, group: tuple) -> int:
    if not -x.ndim <= axis < x.ndim:
        raise OpError(f"{name}: axis {axis} is out of range", x)
    if len(sizes) != len(group):
        raise OpError(f"{name}: {len(sizes)} sizes for a group of {len(group)} ranks")
    return axis % x.ndim


def _with(shape: tuple, axis: int, n: Any) -> tuple:
    return shape[:axis] + (n,) + shape[axis + 1 :]


# ---- the global view -----------------------------------------------------------------------------


def _reshard_meta(x, mesh, placements):
    problem = check(placements, mesh.ndim, x.ndim)
    if problem:
        raise OpError(f"reshard: {problem}", x)
    return Meta(x.shape, x.dtype)


defop(
    "reshard",
    Kind.COLLECTIVE,
    attrs=[attr("mesh", A.MESH), attr("placements", A.PLACEMENTS)],
    infer_meta=_reshard_meta,
    kernel=lambda xp, x, mesh, placements: x,
    vjp=lambda g, out, x, mesh, placements: (O.reshard_like(g, x),),
    spmd=P.RESHARD,
    doc="The same value laid out as `placements` (one per mesh dim) on `mesh`.",
)


def _reshard_like_meta(x, like):
    if x.ndim != like.ndim:  # (a rank's shard of x beside like's global shape is fine)
        raise OpError("reshard_like: x and like must have one rank", x, like)
    return Meta(x.shape, x.dtype)


defop(
    "reshard_like",
    Kind.COLLECTIVE,
    inputs=("x", "like"),
    infer_meta=_reshard_like_meta,
    kernel=lambda xp, x, like: x,
    nondiff={1},
    vjp=lambda g, out, x, like: (g, None),
    traits={"internal"},
    spmd=P.RESHARD_LIKE,
    doc="The same value laid out as `like` is, Partial placements as Replicate (reshard's gradient).",
)


# ---- per-rank collectives --------------------------------------------------------------------------


defop(
    "all_reduce",
    Kind.COLLECTIVE,
    attrs=[_group(), _reduce_attr(), _mesh()],
    infer_meta=lambda x, group, mesh=None, reduce="sum": Meta(x.shape, x.dtype),
    kernel=_kernel("all_reduce"),
    spmd=_PER_RANK,
    doc="Every member gets the reduction of the members' arrays.",
)


def _all_gather_meta(x, group, axis, sizes, mesh=None):
    ax = _axis_meta("all_gather", x, axis, sizes, group)
    return Meta(_with(tuple(x.shape), ax, sum(sizes)), x.dtype)


defop(
    "all_gather",
    Kind.COLLECTIVE,
    attrs=[_group(), attr("axis", A.INT), attr("sizes", A.INTS), _mesh()],
    infer_meta=_all_gather_meta,
    kernel=_kernel("all_gather"),
    spmd=_PER_RANK,
    doc="The members' arrays concatenated along axis (member i holds sizes[i] there).",
)


def _reduce_scatter_meta(x, group, axis, sizes, rank, mesh=None, reduce="sum"):
    ax = _axis_meta("reduce_scatter", x, axis, sizes, group)
    return Meta(_with(tuple(x.shape), ax, sizes[_member("reduce_scatter", group, rank)]), x.dtype)


defop(
    "reduce_scatter",
    Kind.COLLECTIVE,
    attrs=[
        _group(),
        attr("axis", A.INT),
        attr("sizes", A.INTS),
        attr("rank", A.INT),
        _reduce_attr(),
        _mesh(),
    ],
    infer_meta=_reduce_scatter_meta,
    kernel=_kernel("reduce_scatter"),
    spmd=_PER_RANK,
    doc="The members' arrays reduced and cut along axis into sizes; member i keeps piece i.",
)


def _all_to_all_meta(x, group, split_axis, split_sizes, concat_axis, concat_sizes, rank, mesh=None):
    sa = _axis_meta("all_to_all", x, split_axis, split_sizes, group)
    ca = _axis_meta("all_to_all", x, concat_axis, concat_sizes, group)
    i = _member("all_to_all", group, rank)
    shape = _with(_with(tuple(x.shape), sa, split_sizes[i]), ca, sum(concat_sizes))
    return Meta(shape, x.dtype)


defop(
    "all_to_all",
    Kind.COLLECTIVE,
    attrs=[
        _group(),
        attr("split_axis", A.INT),
        attr("split_sizes", A.INTS),
        attr("concat_axis", A.INT),
        attr("concat_sizes", A.INTS),
        attr("rank", A.INT),
        _mesh(),
    ],
    infer_meta=_all_to_all_meta,
    kernel=_kernel("all_to_all"),
    spmd=_PER_RANK,
    doc="Member i sends piece j of x (cut along split_axis) to member j and concatenates what it "
    "receives along concat_axis.",
)


def _send_kernel(xp, x, peer, mesh=None):
    comm = _communicator("send")
    comm.send(comm.rank, peer, x, what=f"dist.send to rank {peer}")
    return x


defop(
    "send",
    Kind.COLLECTIVE,
    attrs=[attr("peer", A.INT), _mesh()],
    infer_meta=lambda x, peer, mesh=None: Meta(x.shape, x.dtype),
    kernel=_send_kernel,
    spmd=_PER_RANK,
    doc="Send x to rank peer (returns x; does not wait for the receiver).",
)


def _recv_kernel(xp, peer, shape, dtype, mesh=None):
    comm = _communicator("recv")
    return comm.recv(peer, comm.rank, shape, dtype, what=f"dist.recv from rank {peer}")


defop(
    "recv",
    Kind.COLLECTIVE,
    inputs=(),
    attrs=[attr("peer", A.INT), attr("shape", A.SHAPE), attr("dtype", A.DTYPE), _mesh()],
    infer_meta=lambda peer, shape, dtype, mesh=None: Meta(shape, dtype),
    kernel=_recv_kernel,
    spmd=_PER_RANK,
    doc="Receive a shape/dtype array from rank peer.",
)
