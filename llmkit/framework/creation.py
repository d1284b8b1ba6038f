"""Creating tensors: from data, constants, ranges and seeded random draws."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import backend as B
from .tensor import Tensor


def _shape(shape: tuple) -> tuple:
    return tuple(shape[0] if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape)


def _dt(dtype: Any) -> np.dtype:
    return B.get_default_dtype() if dtype is None else B.dtype(dtype)


def tensor(data: Any, dtype: Any = None, requires_grad: bool = False, device: str | None = None) -> Tensor:
    """A new tensor holding a copy of ``data`` (nested lists, scalars, numpy/cupy arrays, Tensors).

    Python floats become the default dtype, ints int64 and bools bool, unless ``dtype`` says.
    """
    if isinstance(data, Tensor):
        data = data.numpy() if data.is_concrete else data._data
    device = device or B.get_device()
    xp = B.xp_for(device)
    if B.is_array(data):
        arr = B.to_device(data, device)
        arr = arr.astype(B.dtype(dtype) if dtype is not None else B.dtype(arr.dtype), copy=True)
    else:
        probe = np.asarray(data)
        if dtype is None:
            kind = probe.dtype.kind
            dtype = B.get_default_dtype() if kind == "f" else ("int64" if kind in "iu" else probe.dtype)
        arr = xp.asarray(probe, dtype=B.dtype(dtype))
    return Tensor(arr, requires_grad=requires_grad)


def full(
    shape: Sequence[int],
    value: Any,
    dtype: Any = None,
    requires_grad: bool = False,
    device: str | None = None,
) -> Tensor:
    xp = B.xp_for(device or B.get_device())
    return Tensor(xp.full(tuple(shape), value, dtype=_dt(dtype)), requires_grad=requires_grad)


def zeros(*shape: Any, dtype: Any = None, requires_grad: bool = False, device: str | None = None) -> Tensor:
    return full(_shape(shape), 0, dtype, requires_grad, device)


def ones(*shape: Any, dtype: Any = None, requires_grad: bool = False, device: str | None = None) -> Tensor:
    return full(_shape(shape), 1, dtype, requires_grad, device)


def empty(*shape: Any, dtype: Any = None, device: str | None = None) -> Tensor:
    xp = B.xp_for(device or B.get_device())
    return Tensor(xp.empty(_shape(shape), dtype=_dt(dtype)))


def full_like(x: Tensor, value: Any, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    return full(x.shape, value, x.dtype if dtype is None else dtype, requires_grad, x.device)


def zeros_like(x: Tensor, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    return full_like(x, 0, dtype, requires_grad)


def ones_like(x: Tensor, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    return full_like(x, 1, dtype, requires_grad)


def arange(
    start: int | float,
    end: int | float | None = None,
    step: int | float = 1,
    dtype: Any = None,
    device: str | None = None,
) -> Tensor:
    """``arange(n)`` or ``arange(start, end, step)``; int64 for integer bounds, else the default dtype."""
    if end is None:
        start, end = 0, start
    if dtype is None:
        dtype = "int64" if all(isinstance(v, (int, np.integer)) for v in (start, end, step)) else _dt(None)
    xp = B.xp_for(device or B.get_device())
    return Tensor(xp.arange(start, end, step, dtype=B.dtype(dtype)))


def randn(*shape: Any, dtype: Any = None, requires_grad: bool = False, device: str | None = None) -> Tensor:
    """Standard normal draws from the device's seeded generator (``lf.seed``)."""
    return _draw("standard_normal", shape, dtype, requires_grad, device)


def rand(*shape: Any, dtype: Any = None, requires_grad: bool = False, device: str | None = None) -> Tensor:
    """Uniform draws in [0, 1) from the device's seeded generator."""
    return _draw("random", shape, dtype, requires_grad, device)


def _draw(method: str, shape: tuple, dtype: Any, requires_grad: bool, device: str | None) -> Tensor:
    """Floating draws of the generator's ``method`` (half precision drawn in float64, then cast)."""
    dt = _dt(dtype)
    draw = getattr(B.generator(device or B.get_device()), method)
    a = draw(_shape(shape), dtype=np.float64 if dt.itemsize < 4 else dt)
    return Tensor(a.astype(dt, copy=False), requires_grad=requires_grad)


def randint(
    low: int, high: int, shape: Sequence[int], dtype: Any = "int64", device: str | None = None
) -> Tensor:
    device = device or B.get_device()
    return Tensor(B.generator(device).integers(low, high, size=tuple(shape)).astype(B.dtype(dtype)))
