"""``builtin``: the module, functions, their return, parameters and constants.

A program is one ``builtin.module`` whose block holds ``builtin.func`` ops. A function's body is a
single block whose arguments are the function inputs and whose last op is ``builtin.return``.
``builtin.parameter`` names a weight supplied at run time; ``builtin.constant`` holds a DenseAttr.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...opspec import Trait
from ...placement import check
from ...types import TensorType, Type
from ..attributes import DenseAttr, MeshAttr, StrAttr
from ..core import BlockArgument, Operation, Value
from ..opdef import Dialect, OpDef, OpView, any_attr, is_a, must_end

T = Trait


def _verify_module(op: Operation) -> str | None:
    seen: set[str] = set()
    for region in op.regions:
        for block in region.blocks:
            for f in block:
                if f.name != "builtin.func":
                    return f"a module holds only builtin.func ops, found {f.name}"
                name = f.attributes.get("sym_name")
                if isinstance(name, StrAttr):
                    if name.value in seen:
                        return f"function @{name.value} is defined twice"
                    seen.add(name.value)
    return None


def _verify_func(op: Operation) -> str | None:
    if len(op.regions[0].blocks) != 1:
        return "a function body has exactly one block"
    args = op.attributes.get("arg_placements")
    if args is not None:  # a distributed program: each input's placements on the function's mesh
        mesh = op.attributes.get("mesh")
        if not isinstance(mesh, MeshAttr):
            return "arg_placements need a mesh attribute"
        block_args = op.regions[0].blocks[0].args
        if len(args.value) != len(block_args):
            return f"arg_placements give {len(args.value)} lists for {len(block_args)} inputs"
        for a, ps in zip(block_args, args.value):
            problem = check(ps, mesh.value.ndim, a.type.ndim) if isinstance(ps, tuple) else "not a list"
            if problem:
                return f"input %{a.name or a.index}: {problem}"
    return None


def _constant_infer(operands: Sequence[Value], attrs: Mapping[str, Any]) -> list[Type]:
    v = attrs["value"]
    return [TensorType(v.shape, v.dtype)]


def _verify_parameter(op: Operation) -> str | None:
    return None if isinstance(op.results[0].type, TensorType) else "a parameter is a tensor"


MODULE = OpDef(
    "builtin.module",
    frozenset({T.SYMBOL_TABLE, T.ISOLATED, T.NO_TERMINATOR}),
    num_results=0,
    num_regions=1,
    verify=_verify_module,
    doc="The program: a block of functions.",
)
FUNC = OpDef(
    "builtin.func",
    frozenset({T.SYMBOL, T.ISOLATED}),
    num_results=0,
    num_regions=1,
    attrs={"sym_name": is_a(StrAttr)},
    optional_attrs={"*": any_attr},
    verify=_verify_func,
    doc="A function: its body's entry-block arguments are the inputs, builtin.return the outputs.",
)
RETURN = OpDef(
    "builtin.return",
    frozenset({T.TERMINATOR, T.PURE}),
    max_operands=None,
    num_results=0,
    verify=must_end("builtin.func"),
    doc="Ends a function body, returning its operands.",
)
PARAMETER = OpDef(
    "builtin.parameter",
    frozenset({T.PURE}),
    attrs={"name": is_a(StrAttr)},
    verify=_verify_parameter,
    doc="A named weight, supplied when the program runs.",
)
CONSTANT = OpDef(
    "builtin.constant",
    frozenset({T.PURE, T.CONSTANT_LIKE}),
    attrs={"value": is_a(DenseAttr)},
    infer=_constant_infer,
    doc="A constant tensor (its value attribute).",
)

DIALECT = Dialect("builtin", [MODULE, FUNC, RETURN, PARAMETER, CONSTANT], doc=__doc__ or "")


# ---- views ------------------------------------------------------------------------------------


class FuncOp(OpView):
    """A function: ``name``, ``args`` (inputs), ``body``, ``outputs`` (the returned values)."""

    __slots__ = ()
    OP_NAME = "builtin.func"

    @property
    def name(self) -> str:
        return self.op.attributes["sym_name"].value

    @property
    def args(self) -> list[BlockArgument]:
        return self.body.args

    @property
    def return_op(self) -> Operation | None:
        last = self.body.last
        return last if last is not None and last.name == "builtin.return" else None

    @property
    def outputs(self) -> tuple[Value, ...]:
        r = self.return_op
        return () if r is None else r.operands

    @property
    def input_types(self) -> list[Type]:
        return [a.type for a in self.args]

    @property
    def output_types(self) -> list[Type]:
        return [v.type for v in self.outputs]

    def walk(self):
        """Every op in the body (nested ones included), in program order."""
        for op in self.body:
            yield from op.walk()

    def __len__(self) -> int:
        return sum(1 for _ in self.walk())


class ModuleOp(OpView):
    __slots__ = ()
    OP_NAME = "builtin.module"


class ConstantOp(OpView):
    __slots__ = ()
    OP_NAME = "builtin.constant"

    @property
    def value(self) -> Any:
        """The constant's numpy array (read-only)."""
        return self.op.attributes["value"].value


class ReturnOp(OpView):
    __slots__ = ()
    OP_NAME = "builtin.return"
