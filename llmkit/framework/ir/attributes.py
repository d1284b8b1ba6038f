"""PIR attributes: typed, immutable, hashable compile-time values attached to operations.

Each class wraps one kind of plain Python value (the op table's normalized attribute values):

=============  ==========================  =========================================
class          plain value                 text form
=============  ==========================  =========================================
IntAttr        int                         ``3``, ``-1``
FloatAttr      float (inf/nan allowed)     ``1e-06``, ``0.5``, ``inf``, ``nan``
BoolAttr       bool                        ``true``, ``false``
StrAttr        str                         ``"mean"`` (JSON escapes)
DTypeAttr      numpy dtype                 ``f32``, ``bf16``, ``i64``
DimAttr        symbolic dim (str)          ``S``, ``B*S``, ``S+1``
ShapeAttr      tuple of int | symbol       ``[B, S, 64]``, ``[0, 2, 1]``, ``[]``
ArrayAttr      tuple of anything else      ``[1.5, "a", [1, 2]]``
DictAttr       dict                        ``{eps = 1e-06, name = "x"}``
NoneAttr       None                        ``none``
DenseAttr      numpy array                 ``dense<f32[2] [1.0, 2.0]>`` (large ones by reference)
OpaqueAttr     itself                      ``#kind<p0, p1>`` (extensions)
MeshAttr       ProcessMesh                 ``#mesh<[2, 2], ["dp", "tp"]>`` (ranks third, if not 0..n-1)
PlacementAttr  Placement                   ``#replicate<>``, ``#shard<0>``, ``#partial<"sum">``
=============  ==========================  =========================================

``to_attr(value)`` builds an attribute from a plain value; ``attr.value`` gives it back. A list of
ints or dims is always a :class:`ShapeAttr` (``ArrayAttr`` refuses one), so every value has exactly
one attribute and one text form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import backend as B
from .. import symbolic as sym
from ..placement import Partial, Placement, ProcessMesh, Replicate, Shard
from ..types import check_dim, dtype_short


class Attribute:
    """Base class: immutable; equal when of the same class with equal ``key``."""

    __slots__ = ("_hash",)

    @property
    def value(self) -> Any:
        """The plain Python value (what op-table kernels and infer_meta take)."""
        raise NotImplementedError

    def key(self) -> Any:
        """A hashable identity of the value; equality and hashing use it."""
        raise NotImplementedError

    @property
    def symbolic(self) -> bool:
        """True when the value holds symbolic dims (so it depends on the bound sizes)."""
        return False

    def evaluate(self, env: Mapping[str, int]) -> Any:
        """The plain value with symbolic dims replaced by their sizes in ``env``."""
        return self.value

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is type(self) and self.key() == other.key())

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            h = hash((type(self).__name__, self.key()))
            object.__setattr__(self, "_hash", h)
            return h

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({format_attr(self)})"

    def __str__(self) -> str:
        return format_attr(self)


def _init(obj: Attribute, **fields: Any) -> None:
    for k, v in fields.items():
        object.__setattr__(obj, k, v)


class _Plain(Attribute):
    """An attribute holding one plain value ``_v``, which is also its key."""

    __slots__ = ("_v",)

    @property
    def value(self) -> Any:
        return self._v

    def key(self) -> Any:
        return self._v


class IntAttr(_Plain):
    __slots__ = ()

    def __init__(self, v: int) -> None:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"IntAttr needs an int, got {v!r}")
        _init(self, _v=int(v))


class FloatAttr(_Plain):
    """A float; equality is bitwise-structural (nan equals nan, 0.0 differs from -0.0)."""

    __slots__ = ()

    def __init__(self, v: float) -> None:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"FloatAttr needs a number, got {v!r}")
        _init(self, _v=float(v))

    def key(self) -> Any:
        return "nan" if math.isnan(self._v) else self._v.hex()


class BoolAttr(_Plain):
    __slots__ = ()

    def __init__(self, v: bool) -> None:
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"BoolAttr needs a bool, got {v!r}")
        _init(self, _v=bool(v))


class StrAttr(_Plain):
    __slots__ = ()

    def __init__(self, v: str) -> None:
        if not isinstance(v, str):
            raise TypeError(f"StrAttr needs a str, got {v!r}")
        _init(self, _v=v)


class DTypeAttr(_Plain):
    __slots__ = ()

    def __init__(self, v: Any) -> None:
        _init(self, _v=B.dtype(v))

    def key(self) -> Any:
        return dtype_short(self._v)


class DimAttr(_Plain):
    """A symbolic dim (``"S"``, ``"B*S"``); constant dims are IntAttr."""

    __slots__ = ()

    def __init__(self, v: str) -> None:
        d = check_dim(v)
        if not isinstance(d, str):
            raise TypeError(f"DimAttr needs a symbolic dim; {v!r} is the constant {d} (use IntAttr)")
        _init(self, _v=d)

    @property
    def symbolic(self) -> bool:
        return True

    def evaluate(self, env: Mapping[str, int]) -> int:
        return sym.evaluate(self._v, env)


class ShapeAttr(_Plain):
    """A tuple of dims: ints (negative allowed: ``-1`` in a reshape) or canonical symbols."""

    __slots__ = ("_sym",)

    def __init__(self, dims: Any) -> None:
        out = []
        for d in dims:
            if isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)):
                out.append(int(d))
            elif isinstance(d, str):
                out.append(check_dim(d))
            else:
                raise TypeError(f"ShapeAttr needs ints or symbolic dims, got {d!r}")
        v = tuple(out)
        _init(self, _v=v, _sym=any(type(d) is str for d in v))

    @property
    def symbolic(self) -> bool:
        return self._sym

    def evaluate(self, env: Mapping[str, int]) -> tuple:
        return tuple(sym.evaluate(d, env) for d in self._v) if self._sym else self._v


def _is_dim_attr(a: Attribute) -> bool:
    return type(a) is IntAttr or type(a) is DimAttr


class ArrayAttr(Attribute):
    """A tuple of attributes that is not a list of dims (those are :class:`ShapeAttr`)."""

    __slots__ = ("_items",)

    def __init__(self, items: Any) -> None:
        items = tuple(items)
        for a in items:
            if not isinstance(a, Attribute):
                raise TypeError(f"ArrayAttr holds attributes, got {a!r} (use to_attr)")
        if all(_is_dim_attr(a) for a in items):
            raise TypeError("a list of ints or dims is a ShapeAttr, not an ArrayAttr")
        _init(self, _items=items)

    @property
    def items(self) -> tuple[Attribute, ...]:
        return self._items

    @property
    def value(self) -> tuple:
        return tuple(a.value for a in self._items)

    def key(self) -> Any:
        return self._items

    @property
    def symbolic(self) -> bool:
        return any(a.symbolic for a in self._items)

    def evaluate(self, env: Mapping[str, int]) -> tuple:
        return tuple(a.evaluate(env) for a in self._items)


class DictAttr(Attribute):
    """A mapping from names to attributes (kept in insertion order; compared as a mapping)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any]) -> None:
        d = {}
        for k, a in items.items():
            if not isinstance(k, str):
                raise TypeError(f"DictAttr keys are strings, got {k!r}")
            d[k] = a if isinstance(a, Attribute) else to_attr(a)
        _init(self, _items=d)

    @property
    def items(self) -> Mapping[str, Attribute]:
        return dict(self._items)

    @property
    def value(self) -> dict:
        return {k: a.value for k, a in self._items.items()}

    def key(self) -> Any:
        return tuple(sorted(self._items.items()))

    def __getitem__(self, k: str) -> Attribute:
        return self._items[k]


class NoneAttr(Attribute):
    __slots__ = ()
    _instance: NoneAttr | None = None

    def __new__(cls) -> NoneAttr:
        if cls._instance is None:
            cls._instance = object.__new__(cls)
        return cls._instance

    @property
    def value(self) -> None:
        return None

    def key(self) -> Any:
        return None


class DenseAttr(Attribute):
    """A constant array (read-only copy). Small ones print inline, large ones by reference."""

    __slots__ = ("_arr", "_key")

    def __init__(self, array: Any) -> None:
        arr = np.array(array, copy=True)
        B.dtype(arr.dtype)  # only the framework's dtypes
        arr.setflags(write=False)
        _init(self, _arr=arr)

    @property
    def value(self) -> np.ndarray:
        return self._arr

    @property
    def shape(self) -> tuple[int, ...]:
        return self._arr.shape

    @property
    def dtype(self) -> np.dtype:
        return self._arr.dtype

    def key(self) -> Any:
        try:
            return self._key
        except AttributeError:
            k = (dtype_short(self._arr.dtype), self._arr.shape, self._arr.tobytes())
            object.__setattr__(self, "_key", k)
            return k

    def splat(self) -> Any:
        """The one value every element holds, or None when elements differ (or there are none)."""
        a = self._arr
        if a.size == 0:
            return None
        first = a.flat[0]
        if a.size == 1 or bool(np.all(a == first)):
            return first.item()
        return None


class OpaqueAttr(Attribute):
    """``#kind<p0, p1, ...>``: an extension attribute (placements, meshes) with attribute params."""

    __slots__ = ("_kind", "_params")

    def __init__(self, kind: str, params: Any = ()) -> None:
        if not isinstance(kind, str) or not kind:
            raise TypeError("OpaqueAttr needs a kind name")
        params = tuple(p if isinstance(p, Attribute) else to_attr(p) for p in params)
        _init(self, _kind=kind, _params=params)

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def params(self) -> tuple[Attribute, ...]:
        return self._params

    @property
    def value(self) -> OpaqueAttr:
        return self

    def key(self) -> Any:
        return (self._kind, self._params)


class MeshAttr(OpaqueAttr):
    """A ProcessMesh: ``#mesh<shape, dim names[, ranks]>`` (ranks omitted when they are 0..n-1)."""

    __slots__ = ("_mesh",)

    def __init__(self, mesh: ProcessMesh) -> None:
        params: list[Attribute] = [ShapeAttr(mesh.shape), ArrayAttr(StrAttr(n) for n in mesh.dim_names)]
        if not mesh.is_default_ranks:
            params.append(ShapeAttr(mesh.ranks))
        OpaqueAttr.__init__(self, "mesh", params)
        _init(self, _mesh=mesh)

    @property
    def value(self) -> ProcessMesh:
        return self._mesh

    @classmethod
    def from_params(cls, params: tuple[Attribute, ...]) -> MeshAttr:
        if (
            len(params) not in (2, 3)
            or not isinstance(params[0], ShapeAttr)
            or not isinstance(params[1], ArrayAttr)
        ):
            raise ValueError('#mesh<[sizes], ["names"...], [ranks]?> expected')
        ranks = params[2].value if len(params) == 3 else None
        return cls(ProcessMesh(params[0].value, params[1].value, ranks=ranks))


class PlacementAttr(OpaqueAttr):
    """A placement: ``#replicate<>``, ``#shard<dim>`` or ``#partial<"op">``."""

    __slots__ = ("_p",)

    def __init__(self, p: Placement) -> None:
        if isinstance(p, Shard):
            OpaqueAttr.__init__(self, "shard", [IntAttr(p.dim)])
        elif isinstance(p, Partial):
            OpaqueAttr.__init__(self, "partial", [StrAttr(p.reduce)])
        elif isinstance(p, Replicate):
            OpaqueAttr.__init__(self, "replicate", [])
        else:
            raise TypeError(f"PlacementAttr needs a Placement, got {p!r}")
        _init(self, _p=p)

    @property
    def value(self) -> Placement:
        return self._p


# A placement's kind -> the attribute types of its params and its class.
_PLACEMENTS = {"replicate": ((), Replicate), "shard": ((IntAttr,), Shard), "partial": ((StrAttr,), Partial)}


def _placement_from(kind: str) -> Any:
    def make(params: tuple[Attribute, ...]) -> PlacementAttr:
        types, cls = _PLACEMENTS[kind]
        if tuple(map(type, params)) != types:
            raise ValueError('placements are #replicate<>, #shard<dim> or #partial<"sum|avg|max|min">')
        return PlacementAttr(cls(*(p.value for p in params)))

    return make


# Typed opaque attributes by kind: the text parser builds these instead of a plain OpaqueAttr.
OPAQUE_KINDS = {"mesh": MeshAttr.from_params, **{k: _placement_from(k) for k in _PLACEMENTS}}


def opaque_attr(kind: str, params: Any) -> Attribute:
    """``#kind<params>`` as its typed attribute when the kind is known, else an OpaqueAttr."""
    make = OPAQUE_KINDS.get(kind)
    return OpaqueAttr(kind, params) if make is None else make(tuple(params))


def to_attr(v: Any) -> Attribute:
    """The attribute of a plain Python value (see the table in the module docstring)."""
    if isinstance(v, Attribute):
        return v
    if v is None:
        return NoneAttr()
    if isinstance(v, (bool, np.bool_)):
        return BoolAttr(v)
    if isinstance(v, (int, np.integer)):
        return IntAttr(v)
    if isinstance(v, (float, np.floating)):
        return FloatAttr(v)
    if isinstance(v, str):
        return StrAttr(v)
    if isinstance(v, np.dtype):
        return DTypeAttr(v)
    if isinstance(v, np.ndarray):
        return DenseAttr(v)
    if isinstance(v, Mapping):
        return DictAttr(v)
    if isinstance(v, (tuple, list)):
        if all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) for d in v):
            return ShapeAttr(v)
        return ArrayAttr(to_attr(x) for x in v)
    if isinstance(v, type) and issubclass(v, np.generic):
        return DTypeAttr(v)
    if isinstance(v, ProcessMesh):
        return MeshAttr(v)
    if isinstance(v, Placement):
        return PlacementAttr(v)
    raise TypeError(f"no PIR attribute for {v!r} ({type(v).__name__})")


def dim_attr(d: Any) -> Attribute:
    """IntAttr for a constant dim, DimAttr for a symbolic one."""
    if isinstance(d, str):
        c = check_dim(d)
        return IntAttr(c) if isinstance(c, int) else DimAttr(c)
    return IntAttr(d)


# How an op-table attribute type turns a normalized plain value into an attribute. Types not
# listed fall back to to_attr (so new attribute types work before anyone teaches PIR about them).
_BY_OPTABLE_TYPE = {
    "dtype": DTypeAttr,
    "dim": dim_attr,
    "shape": ShapeAttr,
    "ints": ShapeAttr,
    "axes": ShapeAttr,
    "float": FloatAttr,
    "int": IntAttr,
    "bool": BoolAttr,
    "str": StrAttr,
    "mesh": MeshAttr,
    "placements": lambda v: ArrayAttr(PlacementAttr(p) for p in v),
}


def from_optable(type_name: str, v: Any) -> Attribute:
    """The attribute of an op-table attribute value of type ``type_name`` (``"shape"``, ``"dim?"``...)."""
    if v is None:
        return NoneAttr()
    if type_name == "num_or_sections":
        return IntAttr(v) if isinstance(v, int) else ShapeAttr(v)
    return _BY_OPTABLE_TYPE.get(type_name.rstrip("?"), to_attr)(v)


# ---- the text form of attributes (the printer's; ``str(attr)`` is the same text) ----------------

INLINE_LIMIT = 16  # dense constants with more elements print by reference
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")


# ---- attributes -------------------------------------------------------------------------------


def format_float(x: float) -> str:
    """Shortest text that reads back as the same float (inf/nan spelled out)."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(float(x))


def _element(x: Any, dtype: np.dtype) -> str:
    if dtype.kind == "b":
        return "true" if x else "false"
    if dtype.kind in "iu":
        return str(int(x))
    f = float(x)
    if math.isnan(f) or math.isinf(f) or dtype == np.float64:
        return format_float(f)
    s = str(x)  # numpy's shortest repr for the element's own precision
    if not any(c in s for c in ".en"):
        s += ".0"  # always read as a float
    try:
        if np.array(float(s), dtype=dtype).tobytes() == np.array(x, dtype=dtype).tobytes():
            return s
    except (ValueError, OverflowError):
        pass
    return format_float(f)


def format_dense(a: DenseAttr) -> str:
    arr = a.value
    head = f"{dtype_short(arr.dtype)}[{', '.join(str(d) for d in arr.shape)}]"
    if arr.size <= INLINE_LIMIT:
        return f"dense<{head} [{', '.join(_element(x, arr.dtype) for x in arr.reshape(-1))}]>"
    return f"dense<{head} 0x{np.ascontiguousarray(arr).tobytes().hex().upper()}>"


def format_key(k: str) -> str:
    return k if IDENT.match(k) else quote(k)


def quote(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def format_attr(a: Attribute, resources: dict[DenseAttr, str] | None = None) -> str:
    """One attribute in text form; large dense constants go to ``resources`` when given."""
    t = type(a)
    if t is IntAttr:
        return str(a.value)
    if t is BoolAttr:
        return "true" if a.value else "false"
    if t is FloatAttr:
        return format_float(a.value)
    if t is StrAttr:
        return quote(a.value)
    if t is DTypeAttr:
        return dtype_short(a.value)
    if t is DimAttr:
        return a.value
    if t is ShapeAttr:
        return "[" + ", ".join(str(d) for d in a.value) + "]"
    if t is NoneAttr:
        return "none"
    if t is ArrayAttr:
        return "[" + ", ".join(format_attr(x, resources) for x in a.items) + "]"
    if t is DictAttr:
        return format_attr_dict(a.items, resources)
    if t is DenseAttr:
        if resources is not None and a.value.size > INLINE_LIMIT:
            name = resources.get(a)
            if name is None:
                name = resources[a] = f"r{len(resources)}"
            return f"dense_resource<{name}>"
        return format_dense(a)
    if isinstance(a, OpaqueAttr):
        return f"#{a.kind}<{', '.join(format_attr(p, resources) for p in a.params)}>"
    raise TypeError(f"cannot print attribute {a!r}")


def format_attr_dict(items: Any, resources: dict[DenseAttr, str] | None = None) -> str:
    return "{" + ", ".join(f"{format_key(k)} = {format_attr(v, resources)}" for k, v in items.items()) + "}"
