"""Reductions: fold the axes in ``axis`` (all when None), optionally keeping them as size 1."""

from __future__ import annotations

from math import prod

import numpy as np

from .. import backend as B
from .. import symbolic as sym
from ..dispatch import O
from ..opspec import (
    A,
    Kind,
    Meta,
    OpError,
    attr,
    defop,
    describe,
    norm_axes,
    norm_axis,
    optional,
    reduce_shape,
)
from . import spmd as P


def _keep(g, x, axis, keepdim):
    """Reshape a reduced gradient so it broadcasts against x."""
    return g if keepdim else O.reshape(g, reduce_shape("reduce", x.shape, axis, True))


# SPMD: reducing a sharded axis leaves each rank's partial reduction: Partial(sum | max | min)
# (mean: a Partial sum of each rank's sum over the global count; max/min gather an axis where a rank
# would hold an empty chunk, which has no max).
def _mean_local(regions, x, axis=None, keepdim=False, *, count):
    return O.sum(x, axis=axis, keepdim=keepdim) / float(count)  # the global count: a Partial sum


_PARTIAL = {
    "sum": P.reduction("sum"),
    "mean": P.reduction("sum", local=_mean_local),
    "max": P.reduction("max"),
    "min": P.reduction("min"),
}


def reduction(name, kernel, vjp=None, *, floating=False, numeric=True, out_dtype=None, empty=True, **kw):
    """A reduction op; ``empty=False`` for those with no value over an empty axis (max, min)."""

    def infer(x, axis=None, keepdim=False):
        if not empty and any(x.shape[a] == 0 for a in norm_axes(name, axis, x.ndim)):
            raise OpError(f"{name}: cannot reduce an empty axis (it has no identity)", x)
        if floating and not B.is_floating(x.dtype):
            raise OpError(f"{name}: expects a floating tensor, got {describe(x)}")
        if numeric and x.dtype == B.DTYPES["bool"]:
            raise OpError(f"{name}: expects a numeric tensor, got {describe(x)}; cast it first")
        return Meta(reduce_shape(name, x.shape, axis, keepdim), out_dtype or x.dtype)

    attrs = [attr("axis", A.AXES, None), attr("keepdim", A.BOOL, False)]
    kw.setdefault("spmd", _PARTIAL.get(kw.get("reducer")))
    return defop(name, Kind.REDUCE, attrs=attrs, kernel=kernel, infer_meta=infer, vjp=vjp, **kw)


def _sum_vjp(g, out, x, axis, keepdim):
    return (O.expand(_keep(g, x, axis, keepdim), x.shape),)


def _mean_vjp(g, out, x, axis, keepdim):
    return (O.expand(_keep(g, x, axis, keepdim), x.shape) / O.numel(x, axis=axis),)


def _extreme_vjp(g, out, x, axis, keepdim):
    # The gradient is shared equally between tied extreme elements.
    hit = O.cast(O.equal(x, _keep(out, x, axis, keepdim)), x.dtype)
    return (_keep(g, x, axis, keepdim) * hit / O.sum(hit, axis=axis, keepdim=True),)


def _accumulating(name):
    """The kernel of x.<name> (sum, mean: the array method, cheaper than xp.<name> on small
    arrays) run in the accumulation dtype, cast back to x's."""

    def kernel(xp, x, axis=None, keepdim=False):
        acc = x.dtype if x.dtype.itemsize >= 4 else B.accumulation_dtype(x.dtype)
        if xp is not np:
            return getattr(x, name)(axis=axis, keepdims=keepdim, dtype=acc).astype(x.dtype, copy=False)
        s = np.add.reduce(x, axis, acc, None, keepdim)  # x.sum's own call, less its Python wrapper
        if name == "mean":  # and x.mean's division: by the count as an np.intp
            s = s / np.intp(x.size if axis is None else prod([x.shape[a] for a in axis]))
        return s.astype(x.dtype, copy=False)

    return kernel


reduction("sum", _accumulating("sum"), _sum_vjp, reducer="sum")
reduction("mean", _accumulating("mean"), _mean_vjp, floating=True, reducer="mean")


def extreme(name):
    """max or min over axes: x.<name>, the gradient shared between tied extremes."""

    def kernel(xp, x, axis=None, keepdim=False):
        return getattr(x, name)(axis=axis, keepdims=keepdim)

    return reduction(name, kernel, _extreme_vjp, reducer=name, empty=False)


extreme("max")
extreme("min")


def _logsumexp_kernel(xp, x, axis=None, keepdim=False):
    dtype, x = x.dtype, x.astype(B.accumulation_dtype(x.dtype), copy=False)
    m = xp.max(x, axis=axis, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0)  # all -inf rows give -inf, not nan
    out = (xp.log(xp.sum(xp.exp(x - m), axis=axis, keepdims=True)) + m).astype(dtype, copy=False)
    return out if keepdim else xp.squeeze(out, axis=axis)


def _logsumexp_decompose(x, axis=None, keepdim=False):
    m = O.max(x, axis=axis, keepdim=True)
    m = O.where(O.abs(m) < float("inf"), m, 0.0)
    out = O.log(O.sum(O.exp(x - m), axis=axis, keepdim=True)) + m
    return out if keepdim else O.reshape(out, reduce_shape("logsumexp", x.shape, axis, False))


reduction(
    "logsumexp",
    _logsumexp_kernel,
    floating=True,
    empty=False,
    decompose=_logsumexp_decompose,
    spmd=P.reduction(None, decompose=True),
    vjp=lambda g, out, x, axis, keepdim: (
        _keep(g, x, axis, keepdim) * O.exp(x - _keep(out, x, axis, keepdim)),
    ),
)


def _argmax_meta(x, axis=None, keepdim=False):
    if any(x.shape[a] == 0 for a in norm_axes("argmax", None if axis is None else (axis,), x.ndim)):
        raise OpError("argmax: cannot take the argmax of an empty axis", x)
    if axis is None:
        return Meta((1,) * x.ndim if keepdim else (), "int64")
    return Meta(reduce_shape("argmax", x.shape, (axis,), keepdim), "int64")


def _argmax_kernel(xp, x, axis=None, keepdim=False):
    return xp.argmax(x, axis=axis, keepdims=keepdim).astype("int64", copy=False)


defop(
    "argmax",
    Kind.REDUCE,
    attrs=[attr("axis", optional(A.INT), None), attr("keepdim", A.BOOL, False)],
    kernel=_argmax_kernel,
    infer_meta=_argmax_meta,
    spmd=P.reduction(None),
    doc="Index of the first maximum along axis (of the flattened tensor when axis is None).",
)


def _numel_meta(x, axis=None):
    norm_axes("numel", axis, x.ndim)
    return Meta((), x.dtype)


def _numel_kernel(xp, x, axis=None):
    axes = norm_axes("numel", axis, x.ndim)
    return xp.asarray(prod(x.shape[a] for a in axes), dtype=x.dtype)


def _numel_value(x, axis=None):
    n = sym.product(x.shape[a] for a in norm_axes("numel", axis, x.ndim))
    return n if isinstance(n, int) else None  # known when the counted dims are static


defop(
    "numel",
    Kind.OPAQUE,
    attrs=[attr("axis", A.AXES, None)],
    kernel=_numel_kernel,
    infer_meta=_numel_meta,
    traits={"shape_only"},
    splat=_numel_value,
    spmd=P.Rule(
        lambda ctx: [P.Strategy((P.ANY,), (P.R,))], shape_only=(0,), doc="reads only the global shape"
    ),
    doc="Number of elements in the given axes as a 0-d tensor of x's dtype (sizes may be symbolic).",
)


def _cumsum_meta(x, axis, reverse=False):
    norm_axis("cumsum", axis, x.ndim)
    if x.dtype == B.DTYPES["bool"]:
        raise OpError(f"cumsum: expects a numeric tensor, got {describe(x)}")
    return Meta(x.shape, x.dtype)


def _cumsum_kernel(xp, x, axis, reverse=False):
    if reverse:
        return xp.flip(xp.cumsum(xp.flip(x, axis), axis=axis, dtype=x.dtype), axis)
    return xp.cumsum(x, axis=axis, dtype=x.dtype)


defop(
    "cumsum",
    Kind.OPAQUE,
    attrs=[attr("axis", A.INT, -1), attr("reverse", A.BOOL, False)],
    kernel=_cumsum_kernel,
    infer_meta=_cumsum_meta,
    vjp=lambda g, out, x, axis, reverse: (O.cumsum(g, axis=axis, reverse=not reverse),),
    spmd=P.along_axis(linear=True),
    doc="Inclusive running sum along axis (from the end when reverse).",
)
