"""``canonicalize``: local simplifications, applied to a fixpoint by the worklist driver.

- identities: ``x*1``, ``1*x``, ``x/1``, ``x+0``, ``0+x``, ``x-0`` -> ``x`` (when the result has
  x's type, so broadcasting did not grow it); ``neg(neg(x))`` -> ``x``
- no-op movement: ``cast`` to x's dtype, ``reshape``/``expand``/``squeeze`` to x's shape,
  ``transpose`` by the identity, a full ``slice``, ``concat`` of one tensor -> ``x``
- chains (DRR rules): ``transpose(transpose(x, p), q)`` -> ``transpose(x, p∘q)``;
  ``reshape(reshape(x, a), b)`` -> ``reshape(x, b)``
- order: a constant operand of a commutative op moves to the right (so CSE and the rules above
  see one form)
- dead pure ops are erased along the way.

"One" and "zero" are splat constants: a ``builtin.constant`` whose elements are all equal, an
``llm.full``, ``llm.ones_like`` / ``llm.zeros_like``. Note ``x + 0.0`` -> ``x`` keeps every value
except the sign of a negative zero (as compilers do under no-signed-zeros).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import drr
from ..core import Operation, Value
from ..opdef import Trait
from ..pass_manager import Pass, register_pass
from ..program import Program
from ..rewriter import PatternRewriter, RewritePattern, apply_patterns, pattern

_SPLATS = {
    "llm.zeros_like": lambda op: 0,
    "llm.ones_like": lambda op: 1,
    "llm.full": lambda op: op.plain_attrs["value"],
    "builtin.constant": lambda op: op.attributes["value"].splat(),
}


def splat_value(v: Value) -> Any:
    """The single value every element of ``v`` holds when that is known at compile time."""
    op = getattr(v, "op", None)
    if op is None:
        return None
    f = _SPLATS.get(op.name)
    return None if f is None else f(op)


def _is(v: Value, target: float) -> bool:
    s = splat_value(v)
    return s is not None and not isinstance(s, bool) and s == target


def _forward(op: Operation, rw: PatternRewriter, x: Value) -> None:
    """Replace op's result by ``x`` when the types agree."""
    if op.results[0].type == x.type:
        rw.replace_op(op, [x])


@pattern("llm.add", "llm.sub", "llm.mul", "llm.div")
def binary_identity(op: Operation, rw: PatternRewriter) -> None:
    a, b = op._operands
    unit = 1 if op.name in ("llm.mul", "llm.div") else 0
    if _is(b, unit):
        _forward(op, rw, a)
    elif op.name in ("llm.add", "llm.mul") and _is(a, unit):
        _forward(op, rw, b)


@pattern("llm.neg")
def double_negation(op: Operation, rw: PatternRewriter) -> None:
    inner = getattr(op._operands[0], "op", None)
    if inner is not None and inner.name == "llm.neg":
        _forward(op, rw, inner._operands[0])


@pattern("llm.cast", "llm.reshape", "llm.expand", "llm.squeeze")
def same_type_noop(op: Operation, rw: PatternRewriter) -> None:
    _forward(op, rw, op._operands[0])


@pattern("llm.transpose")
def identity_transpose(op: Operation, rw: PatternRewriter) -> None:
    if op.plain_attrs["perm"] == tuple(range(len(op.plain_attrs["perm"]))):
        _forward(op, rw, op._operands[0])


@pattern("llm.slice")
def full_slice(op: Operation, rw: PatternRewriter) -> None:
    a = op.plain_attrs
    if all(s == 0 for s in a["starts"]) and (a["steps"] is None or all(s == 1 for s in a["steps"])):
        _forward(op, rw, op._operands[0])


@pattern("llm.concat", "llm.stack")
def single_concat(op: Operation, rw: PatternRewriter) -> None:
    if len(op._operands) == 1 and op.name == "llm.concat":
        _forward(op, rw, op._operands[0])


def _is_constant(v: Value) -> bool:
    op = getattr(v, "op", None)
    return op is not None and (Trait.CONSTANT_LIKE in op.opdef.traits or op.name == "llm.full")


class ConstantsRight(RewritePattern):
    """Commutative ``op(c, x)`` -> ``op(x, c)`` when only c is a constant."""

    def match_and_rewrite(self, op: Operation, rw: PatternRewriter) -> None:
        if len(op._operands) != 2 or Trait.COMMUTATIVE not in op.opdef.traits:
            return
        a, b = op._operands
        if _is_constant(a) and not _is_constant(b):
            rw.set_operand(op, 0, b)
            rw.set_operand(op, 1, a)


def _compose(m: drr.Match) -> tuple[int, ...]:
    p, q = m.attr("p"), m.attr("q")
    return tuple(p[i] for i in q)  # out[i] = x[p[q[i]]]


TRANSPOSE_CHAIN = drr.Rule(
    "transpose_transpose",
    source=[
        drr.op("llm.transpose", ["x"], ["t"], perm=drr.Attr("p")),
        drr.op("llm.transpose", ["t"], ["out"], perm=drr.Attr("q")),
    ],
    result=[drr.op("llm.transpose", ["x"], ["out"], perm=drr.Compute(_compose))],
)

RESHAPE_CHAIN = drr.Rule(
    "reshape_reshape",
    source=[
        drr.op("llm.reshape", ["x"], ["r"], shape=drr.Attr("a")),
        drr.op("llm.reshape", ["r"], ["out"], shape=drr.Attr("b")),
    ],
    result=[drr.op("llm.reshape", ["x"], ["out"], shape=drr.Attr("b"))],
)

PATTERNS: list[RewritePattern] = [
    binary_identity,
    double_negation,
    same_type_noop,
    identity_transpose,
    full_slice,
    single_concat,
    ConstantsRight(),
    TRANSPOSE_CHAIN,
    RESHAPE_CHAIN,
]


@register_pass
@dataclass
class Canonicalize(Pass):
    name = "canonicalize"

    def apply(self, program: Program) -> None:
        apply_patterns(program, PATTERNS)
