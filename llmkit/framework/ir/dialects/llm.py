"""``llm``: one op per op-table entry, generated on demand — nobody lists them here.

Collectives (kind ``collective``) are generated the same way into the ``dist`` dialect
(``dist.all_reduce``...). ``llm.<name>`` takes the op's tensor inputs as operands (omitted
optional inputs are simply left out; a variadic op takes all its operands), stores every
attribute (defaults filled in, typed by the op-table attribute type) and has the result types its
``infer_meta`` gives. Traits come from the op's kind and traits; interfaces are its infer_meta,
kernel, vjp and decompose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from ... import ops as _ops  # noqa: F401  (registers every op)
from ...opspec import Kind, OpError, OpSpec, Trait, table
from ...placement import check
from ...types import TensorType, Type
from ..attributes import Attribute, from_optable
from ..core import Operation, Value
from ..opdef import Dialect, Interface, OpDef, OpView, any_attr, lookup

PREFIX = "llm."


def full_name(spec: OpSpec) -> str:
    """``llm.<name>``, or ``dist.<name>`` for a collective."""
    return ("dist." if spec.kind == Kind.COLLECTIVE else PREFIX) + spec.name


def metas_to_types(spec: OpSpec, out: Any) -> list[Type]:
    """infer_meta's result (a TensorType, or a tuple for multi-output ops; a rule may also hand back
    an input, which is a Value under tracing) as PIR types."""
    if spec.multi_output:
        return [TensorType(m.shape, m.dtype) for m in out]
    return [TensorType(out.shape, out.dtype)]


def _traits(spec: OpSpec) -> frozenset[str]:
    out = set(spec.traits)
    if spec.kind != Kind.COLLECTIVE:
        out.add(Trait.PURE)
    if spec.kind == Kind.ELEMENTWISE:
        out.add(Trait.ELEMENTWISE)
        if spec.inputs == ("x",):
            out.add(Trait.SAME_SHAPE)
    return frozenset(out)


def _defaults(spec: OpSpec) -> dict[str, Attribute]:
    out = {}
    for a in spec.attrs:
        if a.name in spec._defaults:
            try:
                v = None if a.default is None else a.type.normalize(a.default)
                out[a.name] = from_optable(a.type.name, v)
            except (TypeError, ValueError):
                pass  # a default PIR cannot express: always printed
    return out


# Auto-parallel annotates an op of a distributed program with its results' placements: a list of
# placements for one result (one per mesh dim of the function's ``mesh``), a list of lists for more.
DIST_ATTR = "placements"


def placements_problem(op: Operation) -> str | None:
    """What is wrong with ``op``'s placements annotation (None when fine or absent)."""
    a = op.attributes.get(DIST_ATTR)
    if a is None:
        return None
    func = op.parent_op
    while func is not None and func.name != "builtin.func":
        func = func.parent_op
    mesh = func.attributes.get("mesh") if func is not None else None
    if mesh is None:
        return "placements need the enclosing function's mesh attribute"
    per = [a.value] if len(op.results) == 1 else list(a.value)
    if len(per) != len(op.results) or not all(isinstance(ps, tuple) for ps in per):
        return f"placements must give one list per result ({len(op.results)})"
    for r, ps in zip(op.results, per):
        problem = check(ps, mesh.value.ndim, r.type.ndim)
        if problem:
            return f"result #{r.index}: {problem}"
    return None


def make_opdef(spec: OpSpec) -> OpDef:
    """The OpDef of one op-table entry."""
    types = {a.name: a.type.name for a in spec.attrs}
    annotated = DIST_ATTR not in types  # its placements annotation is no attribute of the op's own

    def infer(operands: Sequence[Value], attrs: Mapping[str, Any]) -> list[Type]:
        if annotated and DIST_ATTR in attrs:
            attrs = {k: v for k, v in attrs.items() if k != DIST_ATTR}
        return metas_to_types(spec, spec.infer_meta(*operands, **attrs))

    def verify(op: Operation) -> str | None:
        plain = op.plain_attrs
        if annotated and DIST_ATTR in plain:
            problem = placements_problem(op)
            if problem:
                return problem
            plain = {k: v for k, v in plain.items() if k != DIST_ATTR}
        try:
            bound = spec.bind(plain)
        except OpError as e:
            return str(e)
        attrs = op.attributes
        for k, v in bound.items():
            have = attrs.get(k)
            if have is None:
                return f"missing attribute {k!r}"
            want = from_optable(types[k], v)
            if have != want:
                return f"attribute {k!r} = {have} is not in normal form for type {types[k]} (expected {want})"
        return None

    optional = {Interface.VJP: spec.vjp, Interface.DECOMPOSE: spec.decompose}
    interfaces = {Interface.INFER_META: spec.infer_meta, Interface.KERNEL: spec.kernel}
    interfaces.update({k: f for k, f in optional.items() if f is not None})
    return OpDef(
        full_name(spec),
        _traits(spec),
        min_operands=spec.min_inputs,
        max_operands=spec.max_inputs,
        num_results=None if spec.multi_output else 1,
        attrs={a.name: any_attr for a in spec.attrs},  # values are checked by spec.bind in verify
        optional_attrs={DIST_ATTR: any_attr} if annotated else {},  # checked in verify
        infer=infer,
        verify=verify,
        interfaces=interfaces,
        spec=spec,
        defaults=_defaults(spec),
        attr_types=types,
        doc=spec.doc,
    )


class TableDialect(Dialect):
    """Op-table ops seen as a dialect (those ``select`` picks): ``get`` builds (and caches) an
    OpDef per spec."""

    def __init__(self, name: str, select, doc: str = "") -> None:
        super().__init__(name, doc=doc)
        self.select = select

    def get(self, short: str) -> OpDef | None:
        spec = table().get(short)
        if spec is None or not self.select(spec):
            return None
        d = self._ops.get(short)
        if d is None or d.spec is not spec:
            d = self._ops[short] = make_opdef(spec)
        return d

    def names(self) -> list[str]:
        return [f"{self.name}.{n}" for n, s in table().items() if self.select(s)]


DIALECT = TableDialect("llm", lambda s: s.kind != Kind.COLLECTIVE, doc=__doc__ or "")


def opdef(spec_or_name: OpSpec | str) -> OpDef:
    """The OpDef of an op-table op (by spec, bare name or full name)."""
    name = spec_or_name if isinstance(spec_or_name, str) else spec_or_name.name
    spec = table().get(name.split(".", 1)[1] if "." in name else name)
    d = None
    if spec is not None and (name == spec.name or name == full_name(spec)):
        d = lookup(full_name(spec))
    if d is None:
        raise OpError(f"unknown op {name!r}")
    return d


# ---- typed views ------------------------------------------------------------------------------


class LlmOp(OpView):
    """A view of any llm op: its spec, its inputs by name and its attributes as plain values.

    ``LlmOp(op).weight`` is the operand for input ``weight``; ``LlmOp(op).transpose_y`` the plain
    attribute value. ``op_class("matmul")`` gives the generated class for one op.
    """

    __slots__ = ()
    OP_NAME = ""

    def __init__(self, op: Operation) -> None:
        if not op.name.startswith(PREFIX) or (self.OP_NAME and op.name != self.OP_NAME):
            raise TypeError(f"{type(self).__name__} does not view {op.name}")
        object.__setattr__(self, "op", op)

    @classmethod
    def match(cls, op: Operation | None) -> Any:
        if op is None or not op.name.startswith(PREFIX) or (cls.OP_NAME and op.name != cls.OP_NAME):
            return None
        return cls(op)

    @property
    def spec(self) -> OpSpec:
        return self.op.opdef.spec

    def input(self, name: str) -> Value | None:
        """The operand feeding input ``name`` (None for an omitted optional input)."""
        spec = self.spec
        names = spec.input_names
        if spec.variadic:
            raise AttributeError(f"{spec.name} is variadic: use .op.operands")
        i = names.index(name)
        ops = self.op.operands
        return ops[i] if i < len(ops) else None

    def __getattr__(self, name: str) -> Any:
        op = object.__getattribute__(self, "op")
        if name in op.attributes:
            return op.plain_attrs[name]
        spec = op.opdef.spec
        if name in spec.input_names and not spec.variadic:
            return self.input(name)
        raise AttributeError(f"{op.name} has no input or attribute {name!r}")


@cache
def _op_class(name: str) -> type:
    cls_name = "".join(w.capitalize() for w in name.split("_")) + "Op"
    return type(cls_name, (LlmOp,), {"__slots__": (), "OP_NAME": PREFIX + name, "__doc__": table()[name].doc})


def op_class(name: str) -> type:
    """The generated view class of ``llm.<name>`` (``op_class("matmul").match(op)``)."""
    if name.removeprefix(PREFIX) not in table():
        raise OpError(f"unknown op {name!r}")
    return _op_class(name.removeprefix(PREFIX))
