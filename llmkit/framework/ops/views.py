"""Views: reshape, permute, broadcast, slice, join and split (the gathers are in ``indexed.py``).

They compute nothing, so their gradients are other movement ops (the inverse move, or a scatter of
the gathered elements). Sizes may be symbolic: shape arithmetic goes through ``symbolic``.

SPMD: a dim the op does not move across (not sliced, joined, split, gathered along) keeps its
sharding from input to output; the dims it moves across are replicated first. Moving elements is
linear, so Partial values pass through (``linear`` below).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import backend as B
from .. import symbolic as sym
from ..dispatch import O
from ..opspec import (
    A,
    AttrType,
    Kind,
    Meta,
    OpError,
    attr,
    defop,
    describe,
    norm_axes,
    norm_axis,
)
from . import spmd as P

END = 2**63 - 1  # a slice end meaning "to the end of the axis"


def linear(n_in: int, n_out: int = 1, among: Sequence[int] | None = None) -> list:
    """Partial strategies of an op linear in inputs ``among`` (all by default; others replicated)."""
    return P.partials([P.R] * n_in, range(n_in) if among is None else among, n_out=n_out)


def _moving(groups_of, shape_attr: str | None = None, extra=None, globalize=None) -> P.Rule:
    """The rule of a movement op from ``groups_of(ctx) -> ([(input dims, output dims)], number of
    outputs, data inputs)``: those dims keep their sharding, the rest are replicated; Partial data
    inputs (all by default) pass through. ``extra(ctx)`` adds strategies."""

    def strategies(ctx):
        groups, n_out, data = groups_of(ctx)
        more = extra(ctx) if extra is not None else []
        return P.dim_map(ctx, groups, linear(len(ctx.metas), n_out, data) + more)

    return P.Rule(strategies, shape_attr=shape_attr, globalize=globalize, doc="movement")


def _int_index(name: str, x) -> None:
    if not B.is_integer(x.dtype):
        raise OpError(f"{name}: indices must be an integer tensor, got {describe(x)}")


# ---- index maps: how the compiler reads through a view (see OpSpec.index_map) -------------------


def _view_index(ix, out, o, x, **attrs):
    """reshape, squeeze, unsqueeze: the same elements in row-major order."""
    return [(ix.reshape(out, o.shape, x.shape), None)]


def _transpose_index(ix, out, o, x, perm):
    idx = [None] * len(perm)
    for k, p in enumerate(perm):
        idx[p] = out[k]
    return [(tuple(idx), None)]


def _expand_index(ix, out, o, x, shape):
    return [(ix.broadcast(out, x.shape), None)]


def _slice_index(ix, out, o, x, axes, starts, ends, steps=None):
    idx = list(out)
    for a, s, e, st in zip(axes, starts, ends, steps or (1,) * len(axes)):
        a %= x.ndim
        d = x.shape[a]
        if isinstance(d, int):
            lo = slice(s, None if e == END else e, st).indices(d)[0]
        else:
            lo = sym.add(d, s) if s < 0 else s
        idx[a] = out[a] * st + ix.dim(lo)
    return [(tuple(idx), None)]


def _concat_index(ix, out, o, *xs, axis=0):
    a = axis % o.ndim
    entries, off = [], 0
    for i, x in enumerate(xs):
        idx = list(out)
        idx[a] = out[a] - ix.dim(off)
        end = sym.add(off, x.shape[a])
        entries.append((tuple(idx), None if i == len(xs) - 1 else out[a] < ix.dim(end)))
        off = end
    return entries


def _stack_index(ix, out, o, *xs, axis=0):
    a = axis % o.ndim
    idx = tuple(out[:a]) + tuple(out[a + 1 :])
    return [(idx, None if i == len(xs) - 1 else out[a] < ix.dim(i + 1)) for i in range(len(xs))]


# ---- reshape / transpose / expand / squeeze / unsqueeze -----------------------------------------


def _reshape_meta(x, shape):
    numel = sym.product(x.shape)
    if sum(1 for d in shape if d == -1) > 1:
        raise OpError(f"reshape: at most one -1 in shape {list(shape)}")
    if any(isinstance(d, int) and d < -1 for d in shape):
        raise OpError(f"reshape: negative size in shape {list(shape)}")
    if -1 in shape:
        known = sym.product(d for d in shape if d != -1)
        try:
            rest = sym.div(numel, known)
        except (sym.DimError, ZeroDivisionError):
            raise OpError(f"reshape: cannot reshape {describe(x)} into {list(shape)}") from None
        shape = tuple(rest if d == -1 else d for d in shape)
    if sym.canonical(sym.product(shape)) != sym.canonical(numel):
        raise OpError(f"reshape: cannot reshape {describe(x)} into {list(shape)} (sizes differ)")
    return Meta(shape, x.dtype)


defop(
    "reshape",
    Kind.MOVEMENT,
    attrs=[attr("shape", A.SHAPE)],
    infer_meta=_reshape_meta,
    kernel=lambda xp, x, shape: x.reshape(shape),
    vjp=lambda g, out, x, shape: (O.reshape(g, x.shape),),
    index_map=_view_index,
    traits={"same_type_noop", "shape_attr"},
    spmd=P.RESHAPE,
    doc="Same elements, new shape (row-major); one entry may be -1.",
)


def _transpose_meta(x, perm):
    if sorted(perm) != list(range(x.ndim)):
        raise OpError(
            f"transpose: perm {list(perm)} is not a permutation of the {x.ndim} axes of {describe(x)}"
        )
    return Meta(tuple(x.shape[p] for p in perm), x.dtype)


defop(
    "transpose",
    Kind.MOVEMENT,
    attrs=[attr("perm", A.INTS)],
    infer_meta=_transpose_meta,
    kernel=lambda xp, x, perm: x.transpose(perm),
    vjp=lambda g, out, x, perm: (O.transpose(g, tuple(int(i) for i in np.argsort(perm))),),
    index_map=_transpose_index,
    spmd=_moving(lambda ctx: ([((p,), (j,)) for j, p in enumerate(ctx.attrs["perm"])], 1, None)),
    doc="Permute axes: out.shape[i] = x.shape[perm[i]].",
)


def _expand_meta(x, shape):
    if len(shape) < x.ndim:
        raise OpError(f"expand: target shape {list(shape)} has fewer dims than {describe(x)}")
    lead = len(shape) - x.ndim
    out = list(shape[:lead])
    for d, t in zip(x.shape, shape[lead:]):
        if t == -1 or t == d:
            out.append(d)
        elif d == 1:
            out.append(t)
        else:
            raise OpError(f"expand: cannot broadcast {describe(x)} to {list(shape)}")
    return Meta(out, x.dtype)


def _expand_groups(ctx):
    x = ctx.metas[0]
    out = _expand_meta(x, ctx.attrs["shape"]).shape
    lead = len(out) - x.ndim
    return [((d,), (d + lead,)) for d in range(x.ndim) if x.shape[d] == out[d + lead]], 1, None


def _expand_kernel(xp, x, shape):
    return xp.broadcast_to(x, _expand_meta(x, shape).shape)


defop(
    "expand",
    Kind.MOVEMENT,
    attrs=[attr("shape", A.SHAPE)],
    infer_meta=_expand_meta,
    kernel=_expand_kernel,
    vjp=lambda g, out, x, shape: (g,),  # autograd sums the gradient back to x's shape
    index_map=_expand_index,
    traits={"same_type_noop", "shape_attr"},
    spmd=_moving(_expand_groups, shape_attr="shape"),
    doc="Broadcast to a larger shape (numpy broadcast_to); -1 keeps a dim.",
)


def _squeeze_axes(metas, attrs):
    """axis=None squeezes the size-1 dims of the global shape, not of a rank's shard."""
    if attrs["axis"] is not None:
        return attrs
    return {**attrs, "axis": tuple(d for d, n in enumerate(metas[0].shape) if n == 1)}


def _squeeze_meta(x, axis=None):
    if axis is None:
        return Meta([d for d in x.shape if d != 1], x.dtype)
    axes = norm_axes("squeeze", axis, x.ndim)
    for a in axes:
        if x.shape[a] != 1:
            raise OpError(f"squeeze: axis {a} has size {x.shape[a]}, not 1 (input {describe(x)})")
    return Meta([d for i, d in enumerate(x.shape) if i not in axes], x.dtype)


defop(
    "squeeze",
    Kind.MOVEMENT,
    attrs=[attr("axis", A.AXES, None)],
    infer_meta=_squeeze_meta,
    kernel=lambda xp, x, axis=None: x.squeeze(axis),  # axes infer_meta checked
    vjp=lambda g, out, x, axis: (O.reshape(g, x.shape),),
    index_map=_view_index,
    traits={"same_type_noop"},
    spmd=_moving(lambda ctx: (_kept(ctx.metas[0], _squeezed(ctx)), 1, None), globalize=_squeeze_axes),
    doc="Drop size-1 axes.",
)


def _squeezed(ctx):
    x, axis = ctx.metas[0], ctx.attrs["axis"]
    return (
        [d for d in range(x.ndim) if x.shape[d] == 1] if axis is None else norm_axes("squeeze", axis, x.ndim)
    )


def _kept(x, dropped):
    """Input dims not in ``dropped`` paired with their output positions."""
    kept = [d for d in range(x.ndim) if d not in dropped]
    return [((d,), (j,)) for j, d in enumerate(kept)]


def _unsqueeze_meta(x, axis):
    nd = x.ndim + len(axis)
    axes = norm_axes("unsqueeze", axis, nd)
    it = iter(x.shape)
    return Meta([1 if i in axes else next(it) for i in range(nd)], x.dtype)


def _unsqueeze_groups(x, axis):
    nd = x.ndim + len(axis)
    new = norm_axes("unsqueeze", axis, nd)
    kept = [j for j in range(nd) if j not in new]
    return [((d,), (j,)) for d, j in enumerate(kept)]


defop(
    "unsqueeze",
    Kind.MOVEMENT,
    attrs=[attr("axis", A.INTS)],
    infer_meta=_unsqueeze_meta,
    kernel=lambda xp, x, axis: xp.reshape(x, _unsqueeze_meta(x, axis).shape),
    vjp=lambda g, out, x, axis: (O.reshape(g, x.shape),),
    index_map=_view_index,
    spmd=_moving(lambda ctx: (_unsqueeze_groups(ctx.metas[0], ctx.attrs["axis"]), 1, None)),
    doc="Insert size-1 axes at the given output positions.",
)


# ---- slice / slice_scatter ---------------------------------------------------------------------


def _slice_dim(name, d, start, end, step):
    if step == 0:
        raise OpError(f"{name}: step must not be 0")
    if isinstance(d, int):
        return len(range(*slice(start, None if end == END else end, step).indices(d)))
    if step != 1:
        raise OpError(f"{name}: a step other than 1 needs a static size, but the axis is {d!r}")
    lo = sym.add(d, start) if start < 0 else start
    hi = d if end == END else (sym.add(d, end) if end < 0 else end)
    return sym.sub(hi, lo)


def _slice_norm(name, x, axes, starts, ends, steps):
    steps = steps or (1,) * len(axes)
    if not len(axes) == len(starts) == len(ends) == len(steps):
        raise OpError(f"{name}: axes, starts, ends and steps must have the same length")
    axes = tuple(norm_axis(name, a, x.ndim) for a in axes)
    if len(set(axes)) != len(axes):
        raise OpError(f"{name}: repeated axis in {axes}")
    return axes, steps


def _slice_meta(x, axes, starts, ends, steps=None):
    axes, steps = _slice_norm("slice", x, axes, starts, ends, steps)
    shape = list(x.shape)
    for a, s, e, st in zip(axes, starts, ends, steps):
        shape[a] = _slice_dim("slice", shape[a], s, e, st)
    return Meta(shape, x.dtype)


def _slices(ndim, axes, starts, ends, steps):
    idx = [slice(None)] * ndim
    for a, s, e, st in zip(axes, starts, ends, steps or (1,) * len(axes)):
        idx[a % ndim] = slice(s, None if e == END else e, st)
    return tuple(idx)


def _slice_kernel(xp, x, axes, starts, ends, steps=None):
    return x[_slices(x.ndim, axes, starts, ends, steps)]


def _unsliced(ctx, n_in):
    """Dims a slice leaves whole (shared by every input of slice / slice_scatter)."""
    x, a = ctx.metas[0], ctx.attrs
    axes, _ = _slice_norm("slice", x, a["axes"], a["starts"], a["ends"], a["steps"])
    whole = [d for d in range(x.ndim) if d not in axes]
    return [((d,) * n_in, (d,)) for d in whole]


_SLICE_ATTRS = [
    attr("axes", A.INTS),
    attr("starts", A.INTS),
    attr("ends", A.INTS),
    attr("steps", A.AXES, None),
]

defop(
    "slice",
    Kind.MOVEMENT,
    attrs=_SLICE_ATTRS,
    infer_meta=_slice_meta,
    kernel=_slice_kernel,
    vjp=lambda g, out, x, **a: (O.slice_scatter(O.zeros_like(x), g, **a),),
    index_map=_slice_index,
    spmd=_moving(lambda ctx: (_unsliced(ctx, 1), 1, None)),
    doc=f"Python slicing start:end:step along the given axes; end {END} means to the end.",
)


def _slice_scatter_meta(base, src, axes, starts, ends, steps=None):
    want = _slice_meta(base, axes, starts, ends, steps)
    if src.dtype != base.dtype or (
        all(isinstance(d, int) for d in src.shape + want.shape) and tuple(src.shape) != tuple(want.shape)
    ):
        raise OpError(f"slice_scatter: src must be {describe(want)} to fill the slice", base, src)
    return Meta(base.shape, base.dtype)


def _slice_scatter_kernel(xp, base, src, axes, starts, ends, steps=None):
    out = base.copy()
    out[_slices(base.ndim, axes, starts, ends, steps)] = src
    return out


defop(
    "slice_scatter",
    Kind.MOVEMENT,
    inputs=("x", "src"),
    attrs=_SLICE_ATTRS,
    infer_meta=_slice_scatter_meta,
    kernel=_slice_scatter_kernel,
    vjp=lambda g, out, base, src, **a: (O.slice_scatter(g, O.zeros_like(src), **a), O.slice(g, **a)),
    spmd=_moving(lambda ctx: (_unsliced(ctx, 2), 1, None)),
    doc="x with the slice replaced by src (the functional form of x[slice] = src).",
)


# ---- concat / stack / split --------------------------------------------------------------------


def _concat_meta(*xs, axis=0):
    if not xs:
        raise OpError("concat: needs at least one tensor")
    ax = norm_axis("concat", axis, xs[0].ndim)
    for x in xs:
        if (
            x.ndim != xs[0].ndim
            or x.dtype != xs[0].dtype
            or any(i != ax and a != b for i, (a, b) in enumerate(zip(x.shape, xs[0].shape)))
        ):
            raise OpError(f"concat: tensors must match except along axis {axis}", *xs)
    shape = list(xs[0].shape)
    shape[ax] = sym.total(x.shape[ax] for x in xs)
    return Meta(shape, xs[0].dtype)


def _joined(ctx, new):
    """concat (new=0) / stack (new=1): every input's dim d is the output's d (after the axis, +new)."""
    x = ctx.metas[0]
    ax = norm_axis("join", ctx.attrs["axis"], x.ndim + new)
    dims = [d for d in range(x.ndim) if new or d != ax]
    return [((d,) * len(ctx.metas), (d + (new and d >= ax),)) for d in dims]


def _concat_vjp(g, out, *xs, axis=0):
    ax = norm_axis("concat", axis, g.ndim)
    if len(xs) == 1:
        return (g,)
    return O.split(g, tuple(x.shape[ax] for x in xs), axis=ax)


def join(name, xp_fn, infer_meta, vjp, index_map, new_axis, doc):
    """An op joining a list of tensors along ``axis`` with ``xp.<xp_fn>``: ``name([x, y, ...], axis=0)``
    (``new_axis``: 1 when the join makes a new axis, as stack does)."""

    def kernel(xp, *xs, axis=0):
        return getattr(xp, xp_fn)(xs, axis=axis)

    attrs = [attr("axis", A.INT, 0)]
    spmd = _moving(lambda ctx: (_joined(ctx, new_axis), 1, None))
    return defop(name, Kind.MOVEMENT, inputs=("*xs",), attrs=attrs, kernel=kernel, infer_meta=infer_meta,
                 vjp=vjp, index_map=index_map, spmd=spmd, doc=doc)  # fmt: skip


join(
    "concat",
    "concatenate",
    _concat_meta,
    _concat_vjp,
    _concat_index,
    0,
    "Join tensors along an existing axis.",
)


def _stack_meta(*xs, axis=0):
    if not xs:
        raise OpError("stack: needs at least one tensor")
    for x in xs:
        if tuple(x.shape) != tuple(xs[0].shape) or x.dtype != xs[0].dtype:
            raise OpError("stack: tensors must all have the same shape and dtype", *xs)
    ax = norm_axis("stack", axis, xs[0].ndim + 1)
    shape = list(xs[0].shape)
    shape.insert(ax, len(xs))
    return Meta(shape, xs[0].dtype)


def _stack_vjp(g, out, *xs, axis=0):
    parts = O.split(g, len(xs), axis=axis) if len(xs) > 1 else (g,)
    return tuple(O.reshape(p, x.shape) for p, x in zip(parts, xs))


join("stack", "stack", _stack_meta, _stack_vjp, _stack_index, 1, "Join same-shaped tensors along a new axis.")


def _num_or_sections(v):
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        if v < 1:
            raise TypeError("a positive number of parts or a list of sizes")
        return int(v)
    try:
        return A.SHAPE.normalize(v)
    except TypeError:
        raise TypeError("a number of parts or a list of sizes") from None


NUM_OR_SECTIONS = AttrType("num_or_sections", _num_or_sections)


def _split_sizes(x, sections, axis):
    ax = norm_axis("split", axis, x.ndim)
    d = x.shape[ax]
    if isinstance(sections, int):
        try:
            part = sym.div(d, sections)
        except sym.DimError:
            raise OpError(
                f"split: axis {axis} of {describe(x)} does not split into {sections} equal parts"
            ) from None
        return ax, (part,) * sections
    if sym.canonical(sym.total(sections)) != sym.canonical(d):
        raise OpError(f"split: sizes {list(sections)} do not add up to axis {axis} of {describe(x)}")
    return ax, tuple(sections)


def _split_meta(x, sections, axis=0):
    ax, sizes = _split_sizes(x, sections, axis)
    return tuple(Meta(x.shape[:ax] + (s,) + x.shape[ax + 1 :], x.dtype) for s in sizes)


def _split_kernel(xp, x, sections, axis=0):
    ax, sizes = _split_sizes(x, sections, axis)
    return tuple(xp.split(x, np.cumsum(sizes[:-1]).tolist(), axis=ax))


def _split_groups(ctx):
    x, a = ctx.metas[0], ctx.attrs
    ax, sizes = _split_sizes(x, a["sections"], a["axis"])
    return [((d,), (d,) * len(sizes)) for d in range(x.ndim) if d != ax], len(sizes), None


def _split_vjp(gs, outs, x, sections, axis=0):
    return (O.concat([g if g is not None else O.zeros_like(o) for g, o in zip(gs, outs)], axis=axis),)


defop(
    "split",
    Kind.MOVEMENT,
    attrs=[attr("sections", NUM_OR_SECTIONS), attr("axis", A.INT, 0)],
    infer_meta=_split_meta,
    kernel=_split_kernel,
    vjp=_split_vjp,
    multi_output=True,
    spmd=_moving(_split_groups),
    doc="Split along axis into a number of equal parts or into parts of the given sizes.",
)
