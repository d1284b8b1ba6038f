"""Gather and scatter ops, and the ones built by index: embedding, masks, one-hot, top-k, ranges.

They select or place elements by an index tensor (or make them from shapes), so, unlike the views
(``views.py``), the compiler cannot read through them: each is its own kernel. Their gradients are
the matching scatter (``index_add``, ``scatter_add``) or none (masks, ranges, ``topk``'s indices).

SPMD: as for the views, a dim the op does not index keeps its sharding; an embedding or index
table sharded on its rows (vocab parallel) is looked up by every rank for the rows it holds.
"""

from __future__ import annotations

import numpy as np

from .. import backend as B
from .. import symbolic as sym
from ..dispatch import O
from ..opspec import A, Kind, Meta, OpError, attr, defop, describe, norm_axis, optional
from . import spmd as P
from .views import _int_index, _moving

# ---- gather / scatter --------------------------------------------------------------------------


def _indexed(ctx, data, index_dims):
    """gather-like ops: dims other than the axis shard together in the data inputs ``data``, the
    index (input 1; with ``index_dims`` it has those dims too) and the output; a sharded index
    alone shards the output's axis (index_select, gather)."""
    x = ctx.metas[0]
    ax = norm_axis("index", ctx.attrs["axis"], x.ndim)
    n = len(ctx.metas)
    groups = [
        ([d if i in data or (i == 1 and index_dims) else None for i in range(n)], (d,))
        for d in range(x.ndim)
        if d != ax
    ]
    if n == 2:  # index_select / gather: x whole along the axis, the index sharded
        groups.append(((None, ax if index_dims else 0), (ax,)))
    return groups, 1, data


def _own_rows(index, region: slice, rows: int):
    """Global ``index`` into a table of which this rank holds ``rows`` rows from ``region.start``:
    (the index into the local rows, 0 where not held; whether each is held)."""
    local = index - region.start
    valid = O.logical_and(local >= 0, local < rows)
    return O.where(valid, local, 0), valid


def _along(valid, ndim: int, ax: int):
    """A 1-D mask as a broadcastable [1, .., n, .., 1] along ``ax``."""
    return O.reshape(valid, [-1 if d == ax else 1 for d in range(ndim)])


def _select_own(regions, x, index, axis=0):
    """index_select with ``x`` sharded along the axis: a rank picks the slices it holds, zeros for
    the others (their sum over ranks is the selection: a Partial sum)."""
    ax = axis % x.ndim
    local, valid = _own_rows(index, regions[0][ax], x.shape[ax])
    out = O.index_select(x, local, axis=ax)
    return O.where(_along(valid, out.ndim, ax), out, 0)


def _add_own(regions, x, index, src, axis=0):
    """index_add with ``x`` sharded along the axis: a rank adds the slices of src that land in its
    rows (the others add zeros to its first row)."""
    ax = axis % x.ndim
    local, valid = _own_rows(index, regions[0][ax], x.shape[ax])
    return O.index_add(x, local, O.where(_along(valid, src.ndim, ax), src, 0), axis=ax)


def _sharded_table(ctx, out, local):
    """The strategy of an indexed op whose table (input 0) is sharded along the indexed axis, the
    index replicated: ``out`` the output's placement, computed by ``local``."""
    ax = norm_axis("index", ctx.attrs["axis"], ctx.metas[0].ndim)
    if not ctx.nonempty(0, ax):
        return []
    ins = (P.Shard(ax), P.R) + (P.R,) * (len(ctx.metas) - 2)
    return [P.Strategy(ins, (out(ax),), local)]


def _index_select_meta(x, index, axis=0):
    _int_index("index_select", index)
    if index.ndim != 1:
        raise OpError(f"index_select: index must be 1-D, got {describe(index)}")
    ax = norm_axis("index_select", axis, x.ndim)
    return Meta(x.shape[:ax] + (index.shape[0],) + x.shape[ax + 1 :], x.dtype)


defop(
    "index_select",
    Kind.MOVEMENT,
    inputs=("x", "index"),
    attrs=[attr("axis", A.INT, 0)],
    infer_meta=_index_select_meta,
    kernel=lambda xp, x, index, axis=0: xp.take(x, index, axis=axis),
    nondiff={1},
    vjp=lambda g, out, x, index, axis: (O.index_add(O.zeros_like(x), index, g, axis=axis), None),
    spmd=_moving(
        lambda ctx: _indexed(ctx, (0,), index_dims=False),
        extra=lambda ctx: _sharded_table(ctx, lambda ax: P.Partial("sum"), _select_own),
    ),
    doc="out = x.take(index, axis): whole slices picked by a 1-D index.",
)


def _add_at(xp, out, idx, src):
    if xp is np:
        np.add.at(out, idx, src)
    else:
        import cupyx

        cupyx.scatter_add(out, idx, src)
    return out


def _index_add_meta(x, index, src, axis=0):
    want = _index_select_meta(x, index, axis)
    if src.dtype != x.dtype or (
        all(isinstance(d, int) for d in src.shape + want.shape) and tuple(src.shape) != tuple(want.shape)
    ):
        raise OpError(f"index_add: src must be {describe(want)}", x, index, src)
    return Meta(x.shape, x.dtype)


def _index_add_kernel(xp, x, index, src, axis=0):
    ax = axis % x.ndim
    return _add_at(xp, x.copy(), (slice(None),) * ax + (index,), src)


defop(
    "index_add",
    Kind.MOVEMENT,
    inputs=("x", "index", "src"),
    attrs=[attr("axis", A.INT, 0)],
    infer_meta=_index_add_meta,
    kernel=_index_add_kernel,
    nondiff={1},
    vjp=lambda g, out, x, index, src, axis: (g, None, O.index_select(g, index, axis=axis)),
    spmd=_moving(
        lambda ctx: _indexed(ctx, (0, 2), index_dims=False),
        extra=lambda ctx: _sharded_table(ctx, P.Shard, _add_own),
    ),
    doc="x with src's slices added at index along axis (repeated indices accumulate).",
)


def _gather_meta(x, index, axis=0):
    _int_index("gather", index)
    ax = norm_axis("gather", axis, x.ndim)
    if index.ndim != x.ndim or any(
        i != ax and sym.canonical(a) != sym.canonical(b) for i, (a, b) in enumerate(zip(index.shape, x.shape))
    ):
        raise OpError(f"gather: index must have x's shape except along axis {axis}", x, index)
    return Meta(index.shape, x.dtype)


defop(
    "gather",
    Kind.MOVEMENT,
    inputs=("x", "index"),
    attrs=[attr("axis", A.INT, 0)],
    infer_meta=_gather_meta,
    kernel=lambda xp, x, index, axis=0: xp.take_along_axis(x, index, axis=axis),
    nondiff={1},
    vjp=lambda g, out, x, index, axis: (O.scatter_add(O.zeros_like(x), index, g, axis=axis), None),
    spmd=_moving(lambda ctx: _indexed(ctx, (0,), index_dims=True)),
    doc="out[..., i, ...] = x[..., index[..., i, ...], ...] along axis (numpy take_along_axis).",
)


def _scatter_add_meta(x, index, src, axis=0):
    _gather_meta(x, index, axis)
    if src.dtype != x.dtype or tuple(src.shape) != tuple(index.shape):
        raise OpError("scatter_add: src must have index's shape and x's dtype", x, index, src)
    return Meta(x.shape, x.dtype)


def _scatter_add_kernel(xp, x, index, src, axis=0):
    ax = axis % x.ndim
    idx = list(xp.indices(index.shape, sparse=True))
    idx[ax] = index
    return _add_at(xp, x.copy(), tuple(idx), src)


defop(
    "scatter_add",
    Kind.MOVEMENT,
    inputs=("x", "index", "src"),
    attrs=[attr("axis", A.INT, 0)],
    infer_meta=_scatter_add_meta,
    kernel=_scatter_add_kernel,
    nondiff={1},
    vjp=lambda g, out, x, index, src, axis: (g, None, O.gather(g, index, axis=axis)),
    spmd=_moving(lambda ctx: _indexed(ctx, (0, 2), index_dims=True)),
    doc="x plus src added at positions index along axis (the adjoint of gather).",
)


def _embedding_meta(ids, weight):
    _int_index("embedding", ids)
    if weight.ndim != 2:
        raise OpError("embedding: weight must be [num_embeddings, dim]", ids, weight)
    return Meta(tuple(ids.shape) + (weight.shape[1],), weight.dtype)


def _embedding_groups(ctx):
    nd = ctx.metas[0].ndim
    return [((d, None), (d,)) for d in range(nd)] + [((None, 1), (nd,))], 1, (1,)


def _vocab_parallel(regions, ids, weight):
    """Embedding with the vocabulary sharded: a rank looks up the ids in its rows and gives zeros for
    the others (the sum over ranks is the lookup: a Partial sum)."""
    if weight.shape[0] == 0:
        return O.full(tuple(ids.shape) + (weight.shape[1],), 0.0, dtype=weight.dtype)
    local, valid = _own_rows(ids, regions[1][0], weight.shape[0])
    out = O.embedding(local, weight)
    return out * O.unsqueeze(O.cast(valid, weight.dtype), axis=-1)


def _embedding_vjp(g, out, ids, weight):
    flat = O.reshape(ids, [-1])
    return (
        None,
        lambda: O.index_add(O.zeros_like(weight), flat, O.reshape(g, [-1, weight.shape[1]]), axis=0),
    )


defop(
    "embedding",
    Kind.MOVEMENT,
    inputs=("ids", "weight"),
    infer_meta=_embedding_meta,
    kernel=lambda xp, ids, weight: xp.take(weight, ids, axis=0),
    nondiff={0},
    vjp=_embedding_vjp,
    spmd=_moving(
        _embedding_groups,
        extra=lambda ctx: [P.Strategy((P.R, P.Shard(0)), (P.Partial("sum"),), _vocab_parallel)],
    ),
    decompose=lambda ids, weight: O.reshape(
        O.index_select(weight, O.reshape(ids, [-1]), axis=0), tuple(ids.shape) + (weight.shape[1],)
    ),
    doc="Rows of weight picked by integer ids: out[..., :] = weight[ids[...], :].",
)


# ---- masks, one-hot, top-k, ranges -------------------------------------------------------------


def _batch_dims(ctx, last):
    """Every dim but the ``last`` ones keeps its sharding (the triangle's index math needs them whole)."""
    return [((d,), (d,)) for d in range(ctx.metas[0].ndim - last)], 1, None


def triangle(name, doc):
    """tril / triu (``xp.<name>``) of the last two dims; the gradient is the same triangle of g."""

    def infer(x, diagonal=0):
        if x.ndim < 2:
            raise OpError(f"{name}: expects at least 2 dims, got {describe(x)}")
        return Meta(x.shape, x.dtype)

    def kernel(xp, x, diagonal=0):
        return getattr(xp, name)(x, diagonal)

    return defop(name, Kind.OPAQUE, attrs=[attr("diagonal", A.INT, 0)], infer_meta=infer, kernel=kernel,
                 vjp=lambda g, out, x, diagonal: (getattr(O, name)(g, diagonal=diagonal),),
                 spmd=_moving(lambda ctx: _batch_dims(ctx, 2)), doc=doc)  # fmt: skip


triangle("tril", "Keep the lower triangle of the last two dims (j <= i + diagonal), zero the rest.")
triangle("triu", "Keep the upper triangle of the last two dims (j >= i + diagonal), zero the rest.")


def _one_hot_meta(x, num_classes, dtype="float32"):
    _int_index("one_hot", x)
    return Meta(tuple(x.shape) + (num_classes,), dtype)


defop(
    "one_hot",
    Kind.OPAQUE,
    attrs=[
        attr("num_classes", A.INT, check=lambda v: None if v > 0 else "must be > 0"),
        attr("dtype", A.DTYPE, "float32"),
    ],
    infer_meta=_one_hot_meta,
    kernel=lambda xp, x, num_classes, dtype="float32": (x[..., None] == xp.arange(num_classes)).astype(dtype),
    spmd=P.Rule(lambda ctx: P.dim_map(ctx, [((d,), (d,)) for d in range(ctx.metas[0].ndim)]), doc="one_hot"),
    decompose=lambda x, num_classes, dtype="float32": O.cast(
        O.equal(O.unsqueeze(x, axis=-1), O.arange(0, num_classes, dtype=x.dtype)), dtype
    ),
    doc="out[..., c] = 1 where x[...] == c (labels outside [0, num_classes) give all zeros).",
)


def _topk_meta(x, k, axis=-1, largest=True):
    ax = norm_axis("topk", axis, x.ndim)
    if x.dtype == B.DTYPES["bool"] or x.dtype == B.DTYPES["uint8"]:
        raise OpError(f"topk: expects a signed numeric tensor, got {describe(x)}")
    if isinstance(x.shape[ax], int) and not 0 < k <= x.shape[ax]:
        raise OpError(f"topk: k={k} is out of range for axis {axis} of {describe(x)}")
    shape = x.shape[:ax] + (k,) + x.shape[ax + 1 :]
    return Meta(shape, x.dtype), Meta(shape, "int64")


def _topk_kernel(xp, x, k, axis=-1, largest=True):
    # A partition finds each row's k candidates in O(n) (a full sort of a [256, 4096] score batch
    # took 7x longer); only rows where a left-out value ties the k-th (or with NaN, or dtypes
    # numpy cannot partition) take the stable full sort that defines the first-index-wins order.
    key = xp.moveaxis(-x if largest else x, axis, -1)
    n = key.shape[-1]
    if key.dtype.kind not in "fiu" or bool((key != key).any()):
        order = xp.argsort(key, axis=-1, kind="stable")[..., :k]
    else:
        cand = xp.sort(xp.argpartition(key, min(k, n) - 1, axis=-1)[..., :k], axis=-1)  # by index
        ck = xp.take_along_axis(key, cand, axis=-1)
        order = xp.take_along_axis(cand, xp.argsort(ck, axis=-1, kind="stable"), axis=-1)
        ties = (key <= ck.max(axis=-1, keepdims=True)).sum(axis=-1) > k
        if bool(ties.any()):
            order[ties] = xp.argsort(key[ties], axis=-1, kind="stable")[..., :k]
    idx = xp.moveaxis(order.astype("int64", copy=False), -1, axis)
    return xp.take_along_axis(x, idx, axis=axis), idx


defop(
    "topk",
    Kind.OPAQUE,
    attrs=[attr("k", A.INT), attr("axis", A.INT, -1), attr("largest", A.BOOL, True)],
    infer_meta=_topk_meta,
    kernel=_topk_kernel,
    multi_output=True,
    spmd=P.along_axis(outputs=2),
    vjp=lambda gs, outs, x, k, axis, largest: (O.scatter_add(O.zeros_like(x), outs[1], gs[0], axis=axis),),
    doc="The k largest (or smallest) values along axis, sorted, and their int64 indices (first wins ties).",
)


def _arange_meta(start=0, end=None, step=1, dtype="int64"):
    if end is None:
        raise OpError("arange: 'end' is required")
    if B.dtype(dtype) == B.DTYPES["bool"]:
        raise OpError("arange: dtype must be numeric, not bool")
    if isinstance(start, int) and isinstance(end, int):
        n = max(0, len(range(start, end, step)))
    elif step == 1:
        n = sym.sub(end, start)
    else:
        raise OpError(f"arange: a step other than 1 needs static bounds, got {start}..{end}")
    return Meta((n,), dtype)


defop(
    "arange",
    Kind.OPAQUE,
    inputs=(),
    attrs=[
        attr("start", A.DIM, 0),
        attr("end", optional(A.DIM), None),
        attr("step", A.INT, 1, check=lambda v: None if v != 0 else "must not be 0"),
        attr("dtype", A.DTYPE, "int64"),
    ],
    infer_meta=_arange_meta,
    kernel=lambda xp, start=0, end=None, step=1, dtype="int64": xp.arange(start, end, step, dtype=dtype),
    c="({start}+{i0}*{step})",  # a generator: {i0} is the output index
    spmd=P.Rule(lambda ctx: P.dim_map(ctx, []), doc="no inputs: replicated"),
    doc="start, start+step, ... below end (bounds may be symbolic).",
)
