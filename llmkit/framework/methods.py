"""The Tensor methods that compute, installed on :class:`Tensor` by :func:`install`.

They call ops, so they live above the op table (``tensor.py`` only holds the payload and its
values): Python operators, one method per op of the table whose first input is a tensor
(``x.exp()``, ``x.sum(axis=1)``; ``internal`` ops are no methods), and the conveniences written
below (``x.reshape(2, 3)``, ``x.transpose(0, 1)``, ``x[i]``, ``x.backward()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import backend as B
from .autograd import backward
from .dispatch import O, _apply, host_array, public
from .indexing import getitem
from .opspec import Kind, Trait, get, table
from .tensor import Tensor


def _shape_args(args: tuple) -> tuple:
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        return tuple(args[0])
    return tuple(args)


class _Written:
    """Methods written out (installed first, so the per-op methods of the same name give way)."""

    def backward(
        self, grad: Tensor | None = None, retain_graph: bool = False, create_graph: bool = False
    ) -> None:
        """Accumulate gradients of this tensor into the ``.grad`` of every leaf that requires grad."""
        backward(self, grad, retain_graph=retain_graph, create_graph=create_graph)

    def astype(self, dtype: Any) -> Tensor:
        dt = B.dtype(dtype)
        return self if dt == self.dtype else O.cast(self, dtype=dt)

    cast = astype

    def reshape(self, *shape: Any) -> Tensor:
        """``x.reshape(2, -1)`` or ``x.reshape((2, -1))``."""
        shape = _shape_args(shape)
        a = host_array(self)
        if a is not None:
            try:
                return Tensor._wrap(a.reshape(shape))
            except (TypeError, ValueError):  # the op's own error
                pass
        return O.reshape(self, shape=shape)

    view = reshape

    def transpose(self, *perm: Any) -> Tensor:
        """``x.transpose(perm)`` with a full permutation, or ``x.transpose(i, j)`` to swap two axes."""
        p = _shape_args(perm)
        if len(p) == 2 and self.ndim != 2:
            i, j = (a % self.ndim for a in p)
            full = list(range(self.ndim))
            full[i], full[j] = full[j], full[i]
            p = tuple(full)
        return O.transpose(self, perm=p)

    @property
    def T(self) -> Tensor:
        """All axes reversed (numpy's ``.T``)."""
        a = host_array(self)
        if a is not None:
            return Tensor._wrap(a.T)
        return O.transpose(self, perm=tuple(range(self.ndim - 1, -1, -1)))

    def permute(self, *perm: Any) -> Tensor:
        return O.transpose(self, perm=_shape_args(perm))

    def expand(self, *shape: Any) -> Tensor:
        return O.expand(self, shape=_shape_args(shape))

    broadcast_to = expand

    def unsqueeze(self, axis: int | Sequence[int]) -> Tensor:
        return O.unsqueeze(self, axis=axis)

    def chunk(self, n: int, axis: int = 0) -> tuple[Tensor, ...]:
        return O.split(self, sections=n, axis=axis)

    __getitem__ = getitem


# operator -> (op name, reflected?)
_OPERATORS = {
    "__add__": ("add", False),
    "__radd__": ("add", True),
    "__sub__": ("sub", False),
    "__rsub__": ("sub", True),
    "__mul__": ("mul", False),
    "__rmul__": ("mul", True),
    "__truediv__": ("div", False),
    "__rtruediv__": ("div", True),
    "__pow__": ("pow", False),
    "__rpow__": ("pow", True),
    "__matmul__": ("matmul", False),
    "__rmatmul__": ("matmul", True),
    "__lt__": ("less", False),
    "__le__": ("less_equal", False),
    "__gt__": ("greater", False),
    "__ge__": ("greater_equal", False),
    "__eq__": ("equal", False),
    "__ne__": ("not_equal", False),
    "__and__": ("logical_and", False),
    "__or__": ("logical_or", False),
}
_UNARY = {"__neg__": "neg", "__abs__": "abs", "__invert__": "logical_not"}


def install() -> None:
    """Install the written methods, the operators, and a method per op whose first input is a
    tensor (unless Tensor has that name already, or the op is ``internal`` or communication:
    ``dist.reshard`` moves data between ranks)."""
    for name, fn in vars(_Written).items():
        if not name.startswith("__") or name == "__getitem__":
            setattr(Tensor, name, fn)

    def binary(spec, reflected):
        if reflected:
            return lambda self, other: _apply(spec, (other, self), {})
        return lambda self, other: _apply(spec, (self, other), {})

    for dunder, (name, reflected) in _OPERATORS.items():
        setattr(Tensor, dunder, binary(get(name), reflected))
    for dunder, name in _UNARY.items():
        setattr(Tensor, dunder, (lambda spec: lambda self: _apply(spec, (self,), {}))(get(name)))
    for name, spec in table().items():
        if (
            not spec.inputs
            or spec.variadic
            or Trait.INTERNAL in spec.traits
            or spec.kind == Kind.COLLECTIVE
            or hasattr(Tensor, name)
        ):
            continue
        setattr(Tensor, name, public(spec))
