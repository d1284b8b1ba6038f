"""Tensor and Parameter: a payload, its metadata and values, and the fields autograd uses.

A Tensor holds a payload (``_data``): a numpy/cupy array in eager mode, a tracer value inside
``to_static``, a sharded value under auto-parallel. Every computation goes through
``dispatch.apply``, which picks the world from the payload. The methods that compute (operators,
one per op of the table, ``reshape(2, 3)``, ``.T``, ``x[i]``, ``backward``) are installed by
``methods.py``, which sits above the op table; this module imports nothing above the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import backend as B


def _no_values(what: str, t: Tensor) -> Exception:
    return TypeError(f"{what} needs a tensor with concrete values")


_value_error: Callable[[str, Tensor], Exception] = _no_values


def register_value_error(fn: Callable[[str, Tensor], Exception]) -> None:
    """How reading the values of a tensor that has none fails (dispatch: the error of its world)."""
    global _value_error
    _value_error = fn


class Tensor:
    """An n-dimensional array that records the ops applied to it when it requires grad."""

    __slots__ = ("__weakref__", "_data", "_node", "_out_idx", "grad", "name", "requires_grad")
    __array_priority__ = 1000  # numpy scalars defer to our reflected operators

    def __init__(self, data: Any, requires_grad: bool = False, name: str | None = None) -> None:
        self._data = data
        self.requires_grad = requires_grad
        self.grad: Tensor | None = None
        self._node = None
        self._out_idx = 0
        self.name = name

    @classmethod
    def _wrap(cls, data: Any) -> Tensor:
        t = object.__new__(Tensor)
        t._data = data
        t.requires_grad = False
        t.grad = None
        t._node = None
        t._out_idx = 0
        t.name = None
        return t

    # ---- metadata ----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return tuple(self._data.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    @property
    def ndim(self) -> int:
        return len(self._data.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._data.shape))

    def numel(self) -> int:
        return self.size

    @property
    def device(self) -> str:
        return B.device_of(self._data) if self.is_concrete else getattr(self._data, "device", "cpu")

    @property
    def is_concrete(self) -> bool:
        """True when the tensor holds real values (not a tracer or a sharded value)."""
        return B.is_array(self._data)

    @property
    def mesh(self) -> Any:
        """The ProcessMesh of a distributed tensor (None for others)."""
        return getattr(self._data, "mesh", None)

    @property
    def placements(self) -> Any:
        """The placements of a distributed tensor, one per mesh dim (None for others)."""
        return getattr(self._data, "placements", None)

    def local(self) -> Tensor:
        """This rank's shard of a distributed tensor (the tensor itself for others)."""
        local = getattr(self._data, "local", None)
        return self if local is None else Tensor(local())

    @property
    def stop_gradient(self) -> bool:
        """Paddle's spelling of ``not requires_grad``."""
        return not self.requires_grad

    @stop_gradient.setter
    def stop_gradient(self, value: bool) -> None:
        self.requires_grad = not value

    @property
    def is_leaf(self) -> bool:
        return self._node is None

    @property
    def mT(self) -> Tensor:
        """The last two axes swapped."""
        perm = list(range(self.ndim))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return self.transpose(perm)

    # ---- values ------------------------------------------------------------------------------
    def _concrete(self, what: str) -> Any:
        if not self.is_concrete:
            raise _value_error(what, self)
        return self._data

    def numpy(self) -> np.ndarray:
        """The values as a numpy array (shares memory on the CPU)."""
        return B.to_numpy(self._concrete("Tensor.numpy()"))

    def item(self) -> Any:
        a = self._concrete("Tensor.item()")
        if a.size != 1:
            raise ValueError(f"item(): the tensor has {a.size} elements, not 1")
        return a.reshape(()).item()

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        if not B.is_integer(self.dtype):
            raise TypeError(f"only integer tensors can be used as an index, got {B.dtype_name(self.dtype)}")
        return int(self.item())

    def __bool__(self) -> bool:
        a = self._concrete("Python control flow on a tensor value (if/while/and/or/bool())")
        if a.size != 1:
            raise ValueError(
                f"the truth value of a tensor with {a.size} elements is ambiguous; use .any() or .all()"
            )
        return bool(a.reshape(()).item())

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        n = self.shape[0]
        if not isinstance(n, int):
            raise TypeError(f"len() of a tensor whose first dim is symbolic ({n!r})")
        return n

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        dt = B.dtype_name(self.dtype) if self.dtype in B._BY_DTYPE else str(self.dtype)
        if self.is_concrete:
            body = np.array2string(self.numpy(), separator=", ", threshold=64, prefix="Tensor(")
            return f"Tensor({body}, dtype={dt}{grad})"
        return f"Tensor({self._data!r}, shape={list(self.shape)}, dtype={dt}{grad})"

    def __hash__(self) -> int:  # identity, as __eq__ is elementwise
        return id(self)

    def __pos__(self) -> Tensor:
        return self

    # ---- autograd ----------------------------------------------------------------------------
    def detach(self) -> Tensor:
        """The same values, cut from the graph (shares the payload)."""
        return Tensor._wrap(self._data)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        if self._node is not None and not flag:
            raise RuntimeError("requires_grad_(False) on a non-leaf tensor; use detach()")
        self.requires_grad = flag
        return self

    def set_value(self, value: Tensor | Any) -> None:
        """Replace this tensor's values in place (same shape and dtype), keeping its identity.

        Optimizers update parameters with this; under tracing it rebinds the parameter to the new
        traced value, which becomes a program output.
        """
        new = value._data if isinstance(value, Tensor) else value
        if tuple(new.shape) != self.shape or new.dtype != self.dtype:
            raise ValueError(
                f"set_value: expected [{', '.join(map(str, self.shape))}] {B.dtype_name(self.dtype)}, "
                f"got [{', '.join(map(str, new.shape))}] {new.dtype}"
            )
        self._data = new

    # ---- conversion --------------------------------------------------------------------------
    def to(self, target: Any) -> Tensor:
        """``x.to("float16")`` casts (differentiably); ``x.to("gpu")`` copies to another device."""
        if isinstance(target, str) and target in B.DEVICES:
            if self.device == target:
                return self
            t = Tensor(
                B.to_device(self._concrete("Tensor.to(device)"), target), requires_grad=self.requires_grad
            )
            return t
        return self.astype(target)

    def float(self) -> Tensor:
        return self.astype("float32")

    def cpu(self) -> Tensor:
        return self.to("cpu")

    def flatten(self, start: int = 0, end: int = -1) -> Tensor:
        nd = self.ndim
        start, end = start % max(nd, 1), end % max(nd, 1)
        shape = self.shape
        return self.reshape(shape[:start] + (-1,) + shape[end + 1 :])

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError(
            "tensors are immutable: instead of x[i] = v, use ops.slice_scatter (a slice), ops.where (a mask) "
            "or ops.index_add / scatter_add, which return a new tensor"
        )


class Parameter(Tensor):
    """A trainable tensor owned by a Layer: ``requires_grad`` is on unless ``trainable=False``."""

    __slots__ = ()

    def __init__(self, data: Any, trainable: bool = True, name: str | None = None) -> None:
        if isinstance(data, Tensor):
            data = data._data
        super().__init__(data, requires_grad=trainable, name=name)

    @property
    def trainable(self) -> bool:
        return self.requires_grad

    def __repr__(self) -> str:
        return "Parameter" + super().__repr__()[len("Tensor") :]
