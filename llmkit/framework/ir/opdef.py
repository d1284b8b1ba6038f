"""Op definitions, interfaces, typed views and the dialect registry.

An :class:`OpDef` describes one kind of operation: operand and result counts, declared attributes,
regions, traits (names from ``opspec.Trait``, the op table's vocabulary), interfaces (``InferMeta``,
``VJP``...) and an optional extra verifier. A :class:`Dialect` maps op names to OpDefs; the ``llm``
dialect makes its OpDefs from the op table on demand, so no op is ever listed twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..types import Type
from .attributes import Attribute

if TYPE_CHECKING:
    from .core import Block, Operation, Value


class Interface:
    """Interface names: ``opdef.interfaces[name]`` is the implementation."""

    INFER_META = "InferMeta"  # (*metas, **attrs) -> Meta | tuple[Meta, ...]
    VJP = "VJP"  # (g, out, *inputs, **attrs) -> grads
    DECOMPOSE = "Decompose"  # (*inputs, **attrs) -> outputs written with primitives
    KERNEL = "Kernel"  # (xp, *arrays, **attrs) -> array(s): the reference implementation


# An attribute check returns None when fine, else what was expected ("a string", ...).
AttrCheck = Callable[[Attribute], "str | None"]


def is_a(*classes: type) -> AttrCheck:
    names = " or ".join(c.__name__ for c in classes)
    return lambda a: None if isinstance(a, classes) else f"a {names}"


def any_attr(a: Attribute) -> str | None:
    return None


def must_end(parent: str) -> Callable[[Operation], str | None]:
    """The verifier of a terminator that ends the body of a ``parent`` op (and nothing else)."""

    def verify(op: Operation) -> str | None:
        p = op.parent_op
        if p is None or p.name != parent:
            return f"{op.name} must end a {parent} body, not {p.name if p else 'nothing'}"
        return None

    return verify


@dataclass(eq=False)
class OpDef:
    """Everything PIR knows about one kind of operation.

    ``infer(operands, attrs)`` returns the result types (None when results are given explicitly);
    ``verify(op)`` returns an error text or None and runs after the generic checks.
    """

    name: str
    traits: frozenset[str] = frozenset()
    min_operands: int = 0
    max_operands: int | None = 0  # None: variadic
    num_results: int | None = 1  # None: any number
    attrs: Mapping[str, AttrCheck] = field(default_factory=dict)  # required attributes
    optional_attrs: Mapping[str, AttrCheck] = field(default_factory=dict)
    num_regions: int = 0
    infer: Callable[[Sequence[Value], Mapping[str, Any]], list[Type]] | None = None
    verify: Callable[[Operation], str | None] | None = None
    interfaces: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    spec: Any = None  # the OpSpec of an llm op
    defaults: Mapping[str, Attribute] = field(default_factory=dict)  # omitted from the text form
    attr_types: Mapping[str, str] = field(default_factory=dict)  # llm: attribute -> op-table type
    doc: str = ""

    @property
    def dialect(self) -> str:
        return self.name.split(".", 1)[0]

    def operand_problem(self, n: int) -> str | None:
        """What is wrong with ``n`` operands for this op ("expects 2 operands, got 3"), or None."""
        lo, hi = self.min_operands, self.max_operands
        if lo <= n and (hi is None or n <= hi):
            return None
        want = f"at least {lo}" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"
        return f"expects {want} operands, got {n}"

    def __repr__(self) -> str:
        return f"<OpDef {self.name}>"


class OpView:
    """A typed view over an Operation: ``FuncOp(op).body``. Views hold nothing but the op."""

    __slots__ = ("op",)
    OP_NAME: ClassVar[str] = ""

    def __init__(self, op: Operation) -> None:
        if op.name != self.OP_NAME:
            raise TypeError(f"{type(self).__name__} views {self.OP_NAME} ops, not {op.name}")
        self.op = op

    @property
    def body(self) -> Block:
        """The entry block of the op's first region (a function's, a module's, a fusion's body)."""
        return self.op.regions[0].blocks[0]

    @classmethod
    def match(cls, op: Operation | None) -> Any:
        """The view of ``op`` when it is this kind of op, else None."""
        return cls(op) if op is not None and op.name == cls.OP_NAME else None

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.op is self.op  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.op)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.op!r}>"


class Dialect:
    """A namespace of ops. ``get(short_name)`` may build OpDefs lazily (the llm dialect does)."""

    def __init__(self, name: str, ops: Sequence[OpDef] = (), doc: str = "") -> None:
        self.name = name
        self.doc = doc
        self._ops: dict[str, OpDef] = {}
        for d in ops:
            self.add(d)

    def add(self, d: OpDef) -> OpDef:
        short = d.name.split(".", 1)[1]
        if short in self._ops:
            raise ValueError(f"op {d.name} is defined twice")
        self._ops[short] = d
        return d

    def get(self, short: str) -> OpDef | None:
        return self._ops.get(short)

    def names(self) -> list[str]:
        return [f"{self.name}.{n}" for n in self._ops]


_DIALECTS: dict[str, Dialect] = {}
_CACHE: dict[str, OpDef] = {}


def register_dialect(d: Dialect) -> Dialect:
    if d.name in _DIALECTS:
        raise ValueError(f"dialect {d.name!r} is registered twice")
    _DIALECTS[d.name] = d
    return d


def dialects() -> Mapping[str, Dialect]:
    return dict(_DIALECTS)


def lookup(name: str) -> OpDef | None:
    """The OpDef of ``dialect.op``, or None when no dialect defines it."""
    d = _CACHE.get(name)
    if d is not None:
        return d
    dialect, _, short = name.partition(".")
    dia = _DIALECTS.get(dialect)
    if dia is None or not short:
        return None
    d = dia.get(short)
    if d is not None:
        _CACHE[name] = d
    return d


def known_names() -> list[str]:
    """Every op name the dialects know now (for "did you mean" hints)."""
    out: list[str] = []
    for d in _DIALECTS.values():
        out.extend(d.names())
    return out
