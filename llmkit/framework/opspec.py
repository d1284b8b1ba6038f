"""The op spec: one declaration per operator, read by every subsystem.

An :class:`OpSpec` is data plus small functions: the signature (inputs, typed attributes with
defaults), ``infer_meta`` (shapes and dtypes, symbolic dims allowed), ``kernel(xp, ...)`` (the
reference kernel, the same code for numpy and cupy), ``vjp`` (written with other ops, so it runs
eagerly and under tracing alike), ``kind`` (the fusion class, which also supplies default shape
rules), an optional ``decompose`` into primitives, a C expression template for elementwise
primitives, traits (:class:`Trait`), a hand-written C kernel slot (:class:`Native`, filled by
``compiler/native``) and an ``spmd`` slot (filled by auto-parallel). :func:`defop` registers a
spec in the one table; nothing else lists ops.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from . import backend as B
from . import symbolic as sym
from .placement import Placement, ProcessMesh
from .symbolic import Dim
from .types import TensorType

# --------------------------------------------------------------------------------- fusion kinds


class Kind:
    """Fusion classes. A kind also supplies an op's default shape rule."""

    ELEMENTWISE = "elementwise"  # out[i] = f(in[i]...) with broadcasting
    REDUCE = "reduce"  # folds some axes
    MOVEMENT = "movement"  # moves or selects elements, computes nothing
    CONTRACTION = "contraction"  # matmul-like, stays with BLAS
    OPAQUE = "opaque"  # anything else: runs its own kernel
    COLLECTIVE = "collective"  # communication between ranks

    ALL = (ELEMENTWISE, REDUCE, MOVEMENT, CONTRACTION, OPAQUE, COLLECTIVE)


class OpError(ValueError):
    """Bad input to an op: the message names the op and the offending shapes, dtypes or attribute.

    ``OpError(msg, *inputs)`` appends the inputs' shapes and dtypes to the message.
    """

    def __init__(self, msg: str, *inputs: Any) -> None:
        if inputs:
            msg = f"{msg} (inputs: {', '.join(describe(x) for x in inputs)})"
        super().__init__(msg)


# ------------------------------------------------------------------------------------ metadata


# The op table's name for a value's shape and dtype: the one type, PIR's too (``types.py``).
Meta = TensorType


def describe(x: Any) -> str:
    """``[2, 3] float32`` for anything with shape and dtype; repr otherwise."""
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        try:
            dt = B.dtype_name(x.dtype)
        except TypeError:
            dt = str(x.dtype)
        return f"[{', '.join(str(d) for d in x.shape)}] {dt}"
    return repr(x)


# ---------------------------------------------------------------------------------- attributes


class Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED = Required()


@dataclass(frozen=True)
class AttrType:
    """A named attribute type; ``normalize`` returns the canonical (immutable) value or raises."""

    name: str
    normalize: Callable[[Any], Any]

    def __repr__(self) -> str:
        return self.name


def _int(v: Any) -> int:
    if type(v) is int:
        return v
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError("an integer")
    return int(v)


def _float(v: Any) -> float:
    if type(v) is float:
        return v
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError("a number")
    return float(v)


def _bool(v: Any) -> bool:
    if v is True or v is False:
        return v
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError("a bool")
    return bool(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError("a string")
    return v


def _dtype(v: Any) -> np.dtype:
    try:
        return B.dtype(v)
    except TypeError:
        raise TypeError(f"a dtype ({', '.join(B.NAMES)})") from None


def _dim(v: Any) -> Dim:
    if type(v) is int:
        return v
    if isinstance(v, str):
        try:
            return sym.canonical(v)
        except sym.DimError:
            raise TypeError("a dimension (int or symbol)") from None
    return _int(v)


def _is_sequence(v: Any) -> bool:
    """A list, tuple or array (the ABC check last: it is slow)."""
    return type(v) in (tuple, list) or (
        not isinstance(v, (str, bytes)) and isinstance(v, (Sequence, np.ndarray))
    )


def _shape(v: Any) -> tuple:
    if not _is_sequence(v):
        raise TypeError("a shape (a list of ints or symbols)")
    return tuple([_dim(d) for d in v])


def _ints(v: Any) -> tuple:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return (int(v),)
    if not _is_sequence(v):
        raise TypeError("a list of integers")
    return tuple([_int(d) for d in v])


def _axes(v: Any) -> tuple | None:
    return None if v is None else _ints(v)


def _mesh(v: Any) -> ProcessMesh:
    if not isinstance(v, ProcessMesh):
        raise TypeError("a ProcessMesh")
    return v


def _placements(v: Any) -> tuple:
    if isinstance(v, (str, bytes, Placement)) or not isinstance(v, Sequence) or not v:
        raise TypeError("a non-empty list of placements (Replicate(), Shard(dim), Partial(op) or 'S(0)'...)")
    try:
        return tuple(Placement.parse(p) for p in v)
    except (ValueError, TypeError) as e:
        raise TypeError(f"a list of placements ({e})") from None


def optional(t: AttrType) -> AttrType:
    return AttrType(f"{t.name}?", lambda v: None if v is None else t.normalize(v))


def choice(*options: str) -> AttrType:
    def norm(v: Any) -> str:
        if v not in options:
            raise TypeError(f"one of {', '.join(map(repr, options))}")
        return v

    return AttrType("choice(" + ",".join(options) + ")", norm)


class A:
    """The attribute types ops declare."""

    INT = AttrType("int", _int)
    FLOAT = AttrType("float", _float)
    BOOL = AttrType("bool", _bool)
    STR = AttrType("str", _str)
    DTYPE = AttrType("dtype", _dtype)
    DIM = AttrType("dim", _dim)  # an int or a symbolic dim
    SHAPE = AttrType("shape", _shape)
    INTS = AttrType("ints", _ints)
    AXES = AttrType("axes", _axes)  # None (all axes) or a tuple of ints
    MESH = AttrType("mesh", _mesh)  # a ProcessMesh
    PLACEMENTS = AttrType("placements", _placements)  # one Placement per mesh dim


@dataclass(frozen=True)
class AttrSpec:
    name: str
    type: AttrType
    default: Any = REQUIRED
    check: Callable[[Any], str | None] | None = None  # returns an error text, or None when valid


def attr(name: str, type: AttrType, default: Any = REQUIRED, check=None) -> AttrSpec:
    return AttrSpec(name, type, default, check)


# -------------------------------------------------------------------------------------- traits


class Trait:
    """Trait names: one vocabulary for the op table and PIR. Passes and the compiler read traits,
    never op names, so a new op gets a rewrite by declaring its trait (``defop(...,
    traits={"commutative"})``); PIR gives each ``llm`` op its spec's traits as they are, plus
    ``pure`` (every kind but collectives), ``elementwise`` and ``same_shape`` from its kind. Facts
    with a value are spec fields instead: ``identity`` (x op e == x) and ``splat`` (the one value
    of every element)."""

    # algebra
    COMMUTATIVE = "commutative"  # f(a, b) == f(b, a)
    ASSOCIATIVE = "associative"  # f(f(a, b), c) == f(a, f(b, c))
    IDEMPOTENT = "idempotent"  # f(a, a) == a
    INVOLUTION = "involution"  # f(f(x)) == x (canonicalize drops the pair)
    # what rewrites may do
    SAME_TYPE_NOOP = "same_type_noop"  # a result with its input's type is that input (forwarded)
    SHAPE_ATTR = "shape_attr"  # the `shape` attribute is the result's shape, -1 a dim it infers
    SHAPE_ONLY = "shape_only"  # the result depends on the inputs' shapes, not values (splat folds)
    CONSTANT_LIKE = "constant_like"  # no inputs: its value is known when the program is built
    INPLACE_INPUT0 = "inplace_input0"  # may return input 0 itself, written in place (donated)
    # who uses it
    INTERNAL = "internal"  # programs use it (backward, compiler, engine), users not: no Tensor method
    INFERENCE = "inference"  # an engine op (batch-invariant by contract), kernel in compiler/native
    # given by PIR (from an op's kind, or by its dialect)
    PURE = "pure"  # no side effects: removable when unused, mergeable when equal (DCE, CSE)
    RECURSIVELY_PURE = "recursively_pure"  # pure exactly when every op in its regions is
    ELEMENTWISE = "elementwise"  # out[i] = f(in[i], ...) with broadcasting
    SAME_SHAPE = "same_shape"  # the result has the shape of the (single) operand
    TERMINATOR = "terminator"  # ends a block; nothing may follow it
    ISOLATED = "isolated_from_above"  # its regions use no value defined outside them
    SYMBOL = "symbol"  # has a unique name in the enclosing module (functions)
    SYMBOL_TABLE = "symbol_table"  # holds named symbols (the module)
    NO_TERMINATOR = "no_terminator"  # its single-block regions need no terminator

    ALL: ClassVar[frozenset[str]]  # every name above


Trait.ALL = frozenset(v for k, v in vars(Trait).items() if k.isupper())


# ------------------------------------------------------------------------------- native kernels


@dataclass(frozen=True)
class Native:
    """A hand-written C kernel of an op, run in place of ``kernel`` by executors of compiled
    programs. Every one lives in ``compiler/native/``, which attaches it to its op's spec
    (``native_kernel``); ``compiler/native/run.py`` builds and runs it.

    ``source`` defines ``void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads)``
    (the compiler's kernel signature; every name it defines starts with ``KERNEL_FN``, which is
    replaced by the kernel's hashed name), or is a function ``(*metas, **attrs) -> source`` for a
    kernel rendered per op (flash attention: head dims and scale are constants of its C). ``bufs``
    holds the op's given inputs, its outputs, then an ``int64[3]`` status: a kernel that rejects
    its inputs stores a nonzero code there *before* writing anything, and the caller then runs the
    reference kernel, which raises the op's own error. An op with trait ``inplace_input0`` gets
    input 0 itself as its output when it may write in place (else a fresh array, into which the
    kernel copies input 0 first).

    ``applies(*metas, **attrs)`` decides from the program's static types and attributes, once per
    op, whether the kernel handles it (so a program never mixes kernels between calls; where it
    applies, ``decompose`` leaves a composite op whole); ``sizes(*arrays, **attrs)`` gives a call's
    size arguments. Inputs are made contiguous first, unless ``strided`` (the kernel reads them
    through the strides ``sizes`` passes). A native kernel need not match ``kernel`` bit for bit,
    but must keep the op's contract (``tiled_linear``: a row's result does not depend on the other
    rows); ``tests/framework/compiler/test_native.py`` checks each against a float64 formula.
    Eager calls run it too (``dispatch.register_eager_native``), unless ``eager`` is False: a
    kernel that trusts an input only a program's own forward gives (attention's saved lse).
    """

    source: str | Callable[..., str]
    sizes: Callable[..., Sequence[int]]
    applies: Callable[..., bool]
    strided: bool = False
    eager: bool = True


# -------------------------------------------------------------------------------------- the spec


@dataclass(eq=False)
class OpSpec:
    """One operator. See the module docstring for what each field is used by."""

    name: str
    kind: str
    inputs: tuple[str, ...]  # names; "name?" optional (trailing), "*name" variadic (only input)
    attrs: tuple[AttrSpec, ...]
    infer_meta: Callable[..., Any]  # (*metas, **attrs) -> Meta | tuple[Meta, ...]
    kernel: Callable[..., Any]  # (xp, *arrays, **attrs) -> array | tuple[array, ...]
    vjp: Callable[..., Sequence[Any]] | None = None  # (g, out, *inputs, **attrs) -> grad per input
    decompose: Callable[..., Any] | None = None  # (*inputs, **attrs) -> outputs, with other ops
    spmd: Any = None  # the SPMD rule (ops/spmd.py): how the op runs on distributed tensors
    # C/CUDA expression template for elementwise primitives: "({0}+{1})"; {name} is an attribute,
    # {i0} the output index (generators like arange), {ctype} the result's C type
    c: str | None = None
    reducer: str | None = None  # for reductions the compiler lowers: "sum", "mean", "max" or "min"
    # Movement ops that are views: (ix, out_index, out_meta, *in_metas, **attrs) -> one (index, cond)
    # per input, the input index holding out[out_index] (cond: where that input supplies it, or None).
    # The compiler fuses such ops as index arithmetic; ``ix`` offers dim(), reshape(), broadcast().
    index_map: Callable[..., Any] | None = None
    native: Native | None = None  # a hand-written C kernel, attached by compiler/native (see Native)
    traits: frozenset[str] = frozenset()  # names from Trait
    identity: Any = None  # binary ops: x op identity == x (and identity op x == x when commutative)
    # (*metas, **attrs) -> the one value every element of the result holds, or None where unknown
    splat: Callable[..., Any] | None = None
    nondiff: frozenset[int] = frozenset()  # input positions that never get a gradient
    multi_output: bool = False
    doc: str = ""
    _attr_index: dict[str, AttrSpec] = field(default_factory=dict, repr=False)
    _defaults: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._attr_index = {a.name: a for a in self.attrs}
        # Defaults are stored normalized, like values passed in ("float32" -> np.dtype).
        self._defaults = {
            a.name: a.default if a.default is None else a.type.normalize(a.default)
            for a in self.attrs
            if a.default is not REQUIRED
        }
        self.variadic = bool(self.inputs) and self.inputs[0].startswith("*")
        self.min_inputs = sum(1 for n in self.inputs if not n.endswith("?") and not n.startswith("*"))
        self.max_inputs = None if self.variadic else len(self.inputs)
        self.eager: dict = {}  # eager calls' (shapes, dtypes, attributes as given) -> (bound attrs, kernel)

    @property
    def differentiable(self) -> bool:
        return self.vjp is not None

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(n.strip("*?") for n in self.inputs)

    def bind(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Validate attributes and fill defaults; one clear error for anything wrong."""
        out = dict(self._defaults)
        if not attrs and len(out) == len(self.attrs):  # nothing to check (``x @ y``)
            return out
        index = self._attr_index
        for k, v in attrs.items():
            a = index.get(k)
            if a is None:
                known = ", ".join(index) or "none"
                hint = difflib.get_close_matches(k, index, 1)
                raise OpError(
                    f"{self.name}: unknown attribute {k!r}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                    + f"; its attributes are: {known}"
                )
            try:
                v = a.type.normalize(v)
            except TypeError as e:
                raise OpError(f"{self.name}: attribute {k!r} expects {e}, got {v!r}") from None
            if a.check is not None and v is not None:
                problem = a.check(v)
                if problem:
                    raise OpError(f"{self.name}: attribute {k!r}={v!r} is invalid: {problem}")
            out[k] = v
        if len(out) != len(index):
            missing = [a.name for a in self.attrs if a.name not in out]
            raise OpError(f"{self.name}: missing required attribute(s) {', '.join(missing)}")
        return out

    def check_arity(self, n: int) -> None:
        if n < self.min_inputs or (self.max_inputs is not None and n > self.max_inputs):
            want = (
                f"{self.min_inputs}"
                if self.max_inputs == self.min_inputs
                else (
                    f"{self.min_inputs} or more"
                    if self.max_inputs is None
                    else f"{self.min_inputs}-{self.max_inputs}"
                )
            )
            raise OpError(f"{self.name}: expects {want} tensor inputs ({', '.join(self.inputs)}), got {n}")

    def __repr__(self) -> str:
        return f"<op {self.name} ({self.kind})>"


_TABLE: dict[str, OpSpec] = {}


def defop(
    name: str,
    kind: str,
    *,
    kernel: Callable[..., Any],
    inputs: Sequence[str] = ("x",),
    attrs: Sequence[AttrSpec] = (),
    infer_meta: Callable[..., Any],
    vjp: Callable[..., Any] | None = None,
    decompose: Callable[..., Any] | None = None,
    c: str | None = None,
    reducer: str | None = None,
    index_map: Callable[..., Any] | None = None,
    traits: Sequence[str] = (),
    identity: Any = None,
    splat: Callable[..., Any] | None = None,
    nondiff: Sequence[int] = (),
    multi_output: bool = False,
    spmd: Any = None,
    doc: str = "",
) -> OpSpec:
    """Declare an op and add it to the table.

    Families (``unary``, ``binary``, ``reduction``...) call this with their kind's shape rule, so
    most ops only state their kernel and gradient.
    """
    if name in _TABLE:
        raise ValueError(f"op {name!r} is declared twice")
    if kind not in Kind.ALL:
        raise ValueError(f"op {name!r}: unknown kind {kind!r}")
    unknown = set(traits) - Trait.ALL
    if unknown:
        raise ValueError(f"op {name!r}: unknown trait(s) {sorted(unknown)}; the known ones are in Trait")
    spec = OpSpec(
        name=name,
        kind=kind,
        inputs=tuple(inputs),
        attrs=tuple(attrs),
        infer_meta=infer_meta,
        kernel=kernel,
        vjp=vjp,
        decompose=decompose,
        c=c,
        reducer=reducer,
        index_map=index_map,
        traits=frozenset(traits),
        identity=identity,
        splat=splat,
        nondiff=frozenset(nondiff),
        multi_output=multi_output,
        spmd=spmd,
        doc=doc,
    )
    _TABLE[name] = spec
    return spec


def table() -> MappingProxyType:
    """Every op, by name (read-only)."""
    return MappingProxyType(_TABLE)


def get(name: str) -> OpSpec:
    spec = _TABLE.get(name)
    if spec is None:
        hint = difflib.get_close_matches(name, _TABLE, 1)
        raise OpError(f"unknown op {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    return spec


# ---------------------------------------------------------------------- shared shape/dtype rules


def norm_axis(spec_name: str, axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise OpError(f"{spec_name}: axis {axis} is out of range for a rank-{ndim} tensor")
    return axis % ndim


def norm_axes(spec_name: str, axes: tuple | None, ndim: int) -> tuple[int, ...]:
    if axes is None:
        return tuple(range(ndim))
    out = tuple(sorted({norm_axis(spec_name, a, ndim) for a in axes}))
    if len(out) != len(axes):
        raise OpError(f"{spec_name}: repeated axis in {axes}")
    return out


def broadcast_shapes(name: str, *metas: Any) -> tuple:
    shapes = [m.shape for m in metas]
    first = shapes[0]
    if all(s == first for s in shapes):
        return tuple(first)
    nd = max(len(s) for s in shapes)
    out: list[Dim] = []
    for i in range(nd):
        d: Dim = 1
        for s in shapes:
            j = i - (nd - len(s))
            if j < 0:
                continue
            b = sym.broadcast(d, s[j])
            if b is None:
                raise OpError(
                    f"{name}: shapes cannot be broadcast together (dim {s[j]} vs {d})"
                    f" (inputs: {', '.join(describe(m) for m in metas)})"
                )
            d = b
        out.append(d)
    return tuple(out)


def same_dtype(name: str, *metas: Any) -> np.dtype:
    dt = metas[0].dtype
    for m in metas[1:]:
        if m.dtype is not dt and m.dtype != dt:
            raise OpError(
                f"{name}: dtype mismatch ({', '.join(describe(m) for m in metas)}); cast one input first"
            )
    return dt


def elementwise_meta(
    name: str, *metas: Any, floating: bool = False, out_dtype: Any = None, numeric: bool = False
) -> Meta:
    first = metas[0]
    dt, shape = first.dtype, first.shape
    same_shape = True
    for m in metas[1:]:
        if m.dtype is not dt and m.dtype != dt:
            same_dtype(name, *metas)
        if same_shape and m.shape != shape:
            same_shape = False
    if floating and dt not in B.FLOAT_DTYPES:
        raise OpError(f"{name}: expects floating tensors, got {describe(first)}")
    if numeric and dt == B.DTYPES["bool"]:
        raise OpError(f"{name}: expects numeric tensors, got {describe(first)}; cast it first")
    return Meta(
        shape if same_shape else broadcast_shapes(name, *metas), dt if out_dtype is None else out_dtype
    )


def reduce_shape(name: str, shape: tuple, axis: tuple | None, keepdim: bool) -> tuple:
    axes = norm_axes(name, axis, len(shape))
    if keepdim:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)
