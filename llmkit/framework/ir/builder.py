"""``Builder``: creates operations at an insertion point, inferring result types.

::

    f = program.add_function("main", [("x", TensorType(["B", 64], "float32"))])
    b = Builder.at_end(f.body)
    h = b.llm.matmul(f.args[0], w, transpose_y=True)      # a Value (a tuple for multi-output ops)
    op = b.create("llm.add", [h, bias])                    # the Operation
    b.ret(op.result)

``create`` is the tracer's entry point: for llm ops it validates attributes with the op table's
``bind`` and takes result types from ``infer_meta`` (errors are the op table's ``OpError``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..opspec import OpError, OpSpec, table
from ..types import Type
from .attributes import DenseAttr, StrAttr, from_optable, to_attr
from .core import Block, Operation, Region, Value
from .dialects import llm
from .errors import IRError
from .opdef import OpDef, known_names, lookup

_BY_SPEC: dict[int, tuple[OpSpec, OpDef, str, tuple]] = {}


def _llm_entry(spec: OpSpec) -> tuple[OpSpec, OpDef, str, tuple]:
    e = _BY_SPEC.get(id(spec))
    if e is None or e[0] is not spec:
        d = llm.opdef(spec)
        e = (spec, d, d.name, tuple((a.name, a.type.name) for a in spec.attrs))
        _BY_SPEC[id(spec)] = e
    return e


def resolve(name: str | OpSpec) -> OpDef:
    """The OpDef for an op name (``"llm.add"``, or a bare op-table name ``"add"``) or an OpSpec."""
    if isinstance(name, OpSpec):
        return _llm_entry(name)[1]
    d = lookup(name)
    if d is None and "." not in name and name in table():
        d = lookup(llm.full_name(table()[name]))
    if d is None:
        hint = difflib.get_close_matches(name, known_names(), 1)
        raise IRError(f"unknown op {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    return d


class Builder:
    """Inserts new ops into ``block`` before ``before`` (at the end when None)."""

    __slots__ = ("before", "block")

    def __init__(self, block: Block | None = None, before: Operation | None = None) -> None:
        self.block = block
        self.before = before

    @classmethod
    def at_end(cls, block: Block) -> Builder:
        return cls(block)

    @classmethod
    def before_op(cls, op: Operation) -> Builder:
        if op.parent is None:
            raise IRError(f"{op.name} is not in a block")
        return cls(op.parent, op)

    def insert(self, op: Operation) -> Operation:
        if self.block is None:
            raise IRError("the builder has no insertion point")
        return self.block.insert_before(op, self.before)

    def create(
        self,
        op: str | OpSpec,
        operands: Sequence[Value] = (),
        attrs: Mapping[str, Any] | None = None,
        *,
        result_types: Sequence[Type] | None = None,
        regions: Sequence[Region] = (),
        names: Sequence[str | None] | None = None,
        insert: bool = True,
    ) -> Operation:
        """Create (and insert) an op; result types are inferred unless given."""
        if type(op) is OpSpec:
            spec, opdef, name, attr_types = _llm_entry(op)  # type: ignore[arg-type]
        else:
            opdef = resolve(op)  # type: ignore[arg-type]
            spec, name = opdef.spec, opdef.name
            attr_types = _llm_entry(spec)[3] if spec is not None else ()
        if spec is not None:
            spec.check_arity(len(operands))
            plain = spec.bind(attrs or {})
            typed = {k: from_optable(t, plain[k]) for k, t in attr_types}
            if result_types is None:
                result_types = llm.metas_to_types(spec, spec.infer_meta(*operands, **plain))
        else:
            typed = {k: to_attr(v) for k, v in (attrs or {}).items()}
            problem = opdef.operand_problem(len(operands))
            if problem:
                raise IRError(f"{name}: {problem}")
            if result_types is None and opdef.num_results == 0:
                result_types = ()
            elif result_types is None:
                if opdef.infer is None:
                    raise IRError(f"{name}: result types cannot be inferred; pass result_types")
                result_types = opdef.infer(operands, {k: a.value for k, a in typed.items()})
        new = Operation(name, operands, result_types, typed, regions, opdef=opdef, result_names=names)
        if insert:
            self.insert(new)
        return new

    # ---- conveniences -----------------------------------------------------------------------
    @property
    def llm(self) -> _LlmProxy:
        """``b.llm.<op>(*inputs, **attrs)``: create an llm op and return its result value(s)."""
        return _LlmProxy(self)

    def constant(self, value: Any, dtype: Any = None, name: str | None = None) -> Value:
        arr = np.asarray(value, dtype=dtype)
        return self.create("builtin.constant", (), {"value": DenseAttr(arr)}, names=[name]).result

    def parameter(self, name: str, type: Type, value_name: str | None = None) -> Value:
        return self.create(
            "builtin.parameter", (), {"name": StrAttr(name)}, result_types=[type], names=[value_name]
        ).result

    def ret(self, *values: Value) -> Operation:
        return self.create("builtin.return", values)


class _LlmProxy:
    __slots__ = ("_b",)

    def __init__(self, b: Builder) -> None:
        self._b = b

    def __getattr__(self, name: str) -> Any:
        spec = table().get(name)
        if spec is None:
            raise AttributeError(f"no op {name!r} in the op table")
        b = self._b

        def make(*inputs: Any, name: str | None = None, **attrs: Any) -> Any:
            if spec.variadic:
                if len(inputs) != 1 or not isinstance(inputs[0], (list, tuple)):
                    raise OpError(f"{spec.name}: pass the tensors as one list")
                operands = list(inputs[0])
            else:
                operands = list(inputs)
                for nm in spec.input_names[len(operands) :]:
                    operands.append(attrs.pop(nm, None))
                while operands and operands[-1] is None:
                    operands.pop()
            op = b.create(spec, operands, attrs, names=None if name is None else [name])
            return op.results if spec.multi_output else op.results[0]

        return make
