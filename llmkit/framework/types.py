"""Value types: ``TensorType(shape, dtype)`` with int or symbolic dims, and ``ScalarType(dtype)``.

A TensorType is the one description of a value's shape and dtype without data: what an op's
``infer_meta`` takes and returns (``opspec.Meta`` is its name there), the type of a PIR value,
what tracing, the verifier, the executor and the planner read. Types are immutable and interned:
building the same type twice returns the same object, so type equality is usually an identity
check (the verifier compares thousands of them). Text forms: ``f32[B, S, 64]`` is a tensor
(``f32[]`` a 0-d tensor), a bare ``f32`` is a scalar.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import numpy as np

from . import backend as B
from . import symbolic as sym
from .symbolic import Dim

# Short dtype names used by the text form (and accepted wherever a dtype is).
SHORT_NAMES: dict[str, str] = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "bool": "bool",
}
DTYPE_BY_SHORT: dict[str, str] = {s: n for n, s in SHORT_NAMES.items()}  # B.dtype(name): the dtype

# Words that mean something else in the text form, so they cannot be symbol names.
RESERVED = frozenset(DTYPE_BY_SHORT) | {"true", "false", "none", "inf", "nan", "dense", "dense_resource"}


def dtype_short(dtype: np.dtype) -> str:
    """``f32`` for float32 and so on (the text form's dtype names)."""
    return SHORT_NAMES[B.dtype_name(dtype)]


def check_dim(d: Any) -> Dim:
    """Validate and canonicalize one dim: a non-negative int or a symbolic expression."""
    if isinstance(d, (bool, np.bool_)):
        raise TypeError(f"a dim must be an int or a symbol, got {d!r}")
    if isinstance(d, (int, np.integer)):
        if d < 0:
            raise TypeError(f"a dim must be non-negative, got {d}")
        return int(d)
    if isinstance(d, str):
        try:
            c = sym.canonical(d)
        except sym.DimError as e:
            raise TypeError(str(e)) from None
        if isinstance(c, int):
            return check_dim(c)
        bad = sym.symbols(c) & RESERVED
        if bad:
            raise TypeError(f"symbol name {sorted(bad)[0]!r} is reserved in PIR text; rename it")
        return c
    raise TypeError(f"a dim must be an int or a symbol string, got {d!r}")


class Type:
    """Base class of PIR types."""

    __slots__ = ()

    @property
    def shape(self) -> tuple[Dim, ...]:
        return ()

    @property
    def dtype(self) -> np.dtype:
        raise NotImplementedError


class TensorType(Type):
    """A tensor of ``dtype`` with ``shape`` (each dim an int or a canonical symbolic string)."""

    __slots__ = ("_dtype", "_hash", "_shape")
    _cache: ClassVar[dict[tuple, TensorType]] = {}

    def __new__(cls, shape: Any, dtype: Any) -> TensorType:
        key = (shape if type(shape) is tuple else tuple(shape), dtype)
        try:
            hit = cls._cache.get(key)
        except TypeError:  # unhashable dims or dtype: validated (and rejected) below
            hit = None
        if hit is not None:
            return hit
        dims = tuple(check_dim(d) for d in key[0])
        dt = B.dtype(dtype)
        canon = (dims, dt)
        hit = cls._cache.get(canon)
        if hit is None:
            hit = object.__new__(cls)
            hit._shape = dims
            hit._dtype = dt
            hit._hash = hash(canon)
            cls._cache[canon] = hit
        with contextlib.suppress(TypeError):
            cls._cache[key] = hit
        return hit

    def __getnewargs__(self) -> tuple:
        return (self._shape, self._dtype)

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def is_static(self) -> bool:
        """True when every dim is an int."""
        return all(type(d) is int for d in self._shape)

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, TensorType) and self._shape == other._shape and self._dtype == other._dtype
        )

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"{dtype_short(self._dtype)}[{', '.join(str(d) for d in self._shape)}]"

    def __repr__(self) -> str:
        return f"TensorType({self!s})"


class ScalarType(Type):
    """A single number of ``dtype`` (not a tensor); printed as the bare dtype name."""

    __slots__ = ("_dtype",)
    _cache: ClassVar[dict[np.dtype, ScalarType]] = {}

    def __new__(cls, dtype: Any) -> ScalarType:
        dt = B.dtype(dtype)
        hit = cls._cache.get(dt)
        if hit is None:
            hit = object.__new__(cls)
            hit._dtype = dt
            cls._cache[dt] = hit
        return hit

    def __getnewargs__(self) -> tuple:
        return (self._dtype,)

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return 0

    def __str__(self) -> str:
        return dtype_short(self._dtype)

    def __repr__(self) -> str:
        return f"ScalarType({self})"
