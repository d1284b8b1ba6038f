"""``x[index]`` lowered to table ops: slice, squeeze, unsqueeze and index_select.

Supported: ints, slices (any step), ``None``, ``...``, and one integer tensor / array / list index
on one axis. Boolean masks are refused: their result shape depends on the data, which a static
program cannot have; ``ops.where`` is the static way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import backend as B
from .dispatch import O, _apply, host_array
from .ops.views import END
from .opspec import get
from .tensor import Tensor

_PLAIN = (int, slice, type(None), type(Ellipsis))
_PLANS: dict = {}  # (an index of ints, slices, None and ..., the shape) -> its ops: (spec, attrs)


def getitem(x: Tensor, index: Any) -> Tensor:
    idx = index if type(index) is tuple else (index,)
    if type(index) is int or all(
        type(i) in _PLAIN for i in idx
    ):  # no tensor: the ops depend on the shape alone
        key = (
            index
            if type(index) is int
            else tuple((i.start, i.stop, i.step) if type(i) is slice else i for i in idx),
            x.shape,
        )
        plan = _PLANS.get(key)
        if plan is None:
            if len(_PLANS) >= 4096:
                _PLANS.clear()
            plan = _PLANS[key] = _plan(x, idx)[0]
        a = host_array(x)  # a valid index (it has a plan): numpy's basic indexing makes the same view
        if a is not None:
            try:
                v = a[index]
            except TypeError:  # slice bounds that are no ints (the plan makes them ints)
                v = None
            if type(v) is np.ndarray:
                return Tensor._wrap(v)
    else:
        plan, gather, squeeze = _plan(x, idx)
        if gather is not None:
            return _gather(x, plan, gather, squeeze)
    for spec, attrs in plan:
        x = _apply(spec, (x,), attrs)
    return x


def _gather(x: Tensor, plan: list, gather: tuple, squeeze: list) -> Tensor:
    """``x[idx]`` with a tensor index: the plan's slice, the gather, the squeeze, the unsqueeze."""
    steps = {spec.name: (spec, attrs) for spec, attrs in plan}
    if "slice" in steps:
        x = _apply(steps["slice"][0], (x,), steps["slice"][1])
    gdim, t = gather
    x = O.index_select(x, O.reshape(t, [-1]) if t.ndim != 1 else t, axis=gdim)
    if t.ndim != 1:
        shape = list(x.shape)
        x = O.reshape(x, shape[:gdim] + list(t.shape) + shape[gdim + 1 :])
        squeeze = [d + t.ndim - 1 if d > gdim else d for d in squeeze]
    if squeeze:
        x = O.squeeze(x, axis=squeeze)
    return _apply(steps["unsqueeze"][0], (x,), steps["unsqueeze"][1]) if "unsqueeze" in steps else x


def _plan(x: Tensor, idx: tuple) -> tuple[list, Any, list]:
    """The ops of ``x[idx]`` as (spec, attributes): slice, squeeze, unsqueeze (a tensor index: the
    ops around its gather, which the caller makes; returned with its (axis, tensor) and the
    axes to squeeze)."""
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if sum(1 for i in idx if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if n_real > x.ndim:
        raise IndexError(f"too many indices for a tensor of shape {list(x.shape)}")
    expanded: list[Any] = []
    for i in idx:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.ndim - n_real))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (x.ndim - sum(1 for i in expanded if i is not None)))

    axes, starts, ends, steps = [], [], [], []
    squeeze: list[int] = []  # axes of x indexed by an int
    new_axes: list[int] = []  # positions of None in the result
    gather: tuple[int, Any] | None = None
    dim = 0  # axis of x
    pos = 0  # axis of the result
    for i in expanded:
        if i is None:
            new_axes.append(pos)
            pos += 1
            continue
        if isinstance(i, (Tensor, np.ndarray)) and i.dtype == np.bool_:
            raise IndexError(
                "boolean mask indexing gives a data-dependent shape; use ops.where(mask, x, 0) instead"
            )
        if isinstance(i, (bool, np.bool_)):
            raise IndexError("boolean scalars are not valid indices")
        if isinstance(i, (int, np.integer)):
            size = x.shape[dim]
            k = int(i)
            if isinstance(size, int) and not -size <= k < size:
                raise IndexError(f"index {k} is out of bounds for axis {dim} with size {size}")
            axes.append(dim)
            starts.append(k)
            ends.append(END if k == -1 else k + 1)
            steps.append(1)
            squeeze.append(dim)
        elif isinstance(i, slice):
            if i != slice(None):
                step = 1 if i.step is None else int(i.step)
                if step <= 0:
                    raise IndexError("slice steps must be positive")
                axes.append(dim)
                starts.append(0 if i.start is None else int(i.start))
                ends.append(END if i.stop is None else int(i.stop))
                steps.append(step)
            pos += 1
        elif isinstance(i, (Tensor, np.ndarray, list)) or B.is_array(i):
            if gather is not None:
                raise IndexError("only one tensor index per indexing expression is supported")
            t = i if isinstance(i, Tensor) else Tensor(np.asarray(i, dtype=np.int64))
            gather = (dim, t)
            pos += t.ndim
        else:
            raise IndexError(f"unsupported index {i!r}")
        dim += 1

    plan = []
    if axes:
        plan.append(
            (
                get("slice"),
                {"axes": tuple(axes), "starts": tuple(starts), "ends": tuple(ends), "steps": tuple(steps)},
            )
        )
    if squeeze and gather is None:
        plan.append((get("squeeze"), {"axis": tuple(squeeze)}))
    if new_axes:
        plan.append((get("unsqueeze"), {"axis": tuple(new_axes)}))
    return plan, gather, squeeze
