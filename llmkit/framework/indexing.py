"""``x[index]`` lowered to table ops: slice, squeeze, unsqueeze and index_select.

Supported: ints, slices (any step), ``None``, ``...``, and one integer tensor / array / list index
on one axis. Boolean masks are refused: their result shape depends on the data, which a static
program cannot have; ``ops.where`` is the static way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import backend as B
from .dispatch import _VALIDATED_MAX, O, host_array
from .ops.views import END
from .tensor import Tensor

_PLAIN = (int, slice, type(None), type(Ellipsis))
_VALID: set = set()  # (index of ints, slices, None and ..., shape) that the ops below accepted


def getitem(x: Tensor, index: Any) -> Tensor:
    idx = index if isinstance(index, tuple) else (index,)
    key = None
    a = host_array(x)  # no gradient: a valid plain index is numpy's basic indexing (the same view)
    if a is not None and all(type(i) in _PLAIN for i in idx):
        key = (tuple((i.start, i.stop, i.step) if type(i) is slice else i for i in idx), a.shape)
        if key in _VALID:
            return Tensor._wrap(np.asarray(a[index]))  # (a scalar for an int per axis: made 0-d)
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

    out = x
    if axes:
        out = O.slice(out, axes=tuple(axes), starts=tuple(starts), ends=tuple(ends), steps=tuple(steps))
    if gather is not None:
        gdim, t = gather
        out = O.index_select(out, O.reshape(t, [-1]) if t.ndim != 1 else t, axis=gdim)
        if t.ndim != 1:
            shape = list(out.shape)
            out = O.reshape(out, shape[:gdim] + list(t.shape) + shape[gdim + 1 :])
            squeeze = [d + t.ndim - 1 if d > gdim else d for d in squeeze]
    if squeeze:
        out = O.squeeze(out, axis=tuple(squeeze))
    if new_axes:
        out = O.unsqueeze(out, axis=tuple(new_axes))
    bounds = [b for i in idx if type(i) is slice for b in (i.start, i.stop, i.step) if b is not None]
    if key is not None and all(type(b) is int for b in bounds):  # (numpy refuses what int() took)
        if len(_VALID) >= _VALIDATED_MAX:  # bounded as the ops' own signature caches
            _VALID.clear()
        _VALID.add(key)
    return out
