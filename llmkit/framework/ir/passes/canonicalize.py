"""``canonicalize``: local simplifications, applied to a fixpoint by the worklist driver.

What an op allows is read from its op-table spec, never from its name:

- identity elements (``spec.identity``): ``x op e`` -> ``x``, and ``e op x`` -> ``x`` for commutative
  ops (``x*1``, ``x/1``, ``x+0``, ``0+x``, ``x-0``), when the result has x's type (broadcasting
  did not grow it)
- involutions (trait ``involution``): ``f(f(x))`` -> ``x`` (``neg(neg(x))``)
- trait ``same_type_noop``: a result with its input's type is the input (``cast`` to x's dtype,
  ``reshape``/``expand``/``squeeze`` to x's shape)
- per-op rules: ``transpose`` by the identity, a full ``slice``, ``concat`` of one tensor -> ``x``;
  chains (DRR): ``transpose(transpose(x, p), q)`` -> ``transpose(x, p∘q)``,
  ``reshape(reshape(x, a), b)`` -> ``reshape(x, b)``
- order: a constant operand of a commutative op moves to the right (so CSE and the rules above
  see one form)
- dead pure ops are erased along the way.

"One" and "zero" are splat values: a ``builtin.constant`` whose elements are all equal, or an op
whose ``splat`` rule knows its value (``full``, ``ones_like``, ``zeros_like``). Note ``x + 0.0``
-> ``x`` keeps every value except the sign of a negative zero (as compilers do under
no-signed-zeros).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...opspec import Trait
from .. import drr
from ..core import Operation, Value
from ..pass_manager import Pass, register_pass
from ..program import Program
from ..rewriter import PatternRewriter, RewritePattern, apply_patterns, pattern


def splat_value(v: Value) -> Any:
    """The single value every element of ``v`` holds when that is known at compile time."""
    op = getattr(v, "op", None)
    if op is None:
        return None
    if op.name == "builtin.constant":
        return op.attributes["value"].splat()
    spec = op.opdef.spec
    return None if spec is None or spec.splat is None else spec.splat(*op._operands, **op.plain_attrs)


def _is(v: Value, target: float) -> bool:
    s = splat_value(v)
    return s is not None and not isinstance(s, bool) and s == target


def _forward(op: Operation, rw: PatternRewriter, x: Value) -> None:
    """Replace op's result by ``x`` when the types agree."""
    if op.results[0].type == x.type:
        rw.replace_op(op, [x])


@pattern()
def identity_element(op: Operation, rw: PatternRewriter) -> None:
    spec = op.opdef.spec
    if spec is None or spec.identity is None:
        return
    a, b = op._operands
    if _is(b, spec.identity):
        _forward(op, rw, a)
    elif Trait.COMMUTATIVE in op.opdef.traits and _is(a, spec.identity):
        _forward(op, rw, b)


@pattern()
def involution(op: Operation, rw: PatternRewriter) -> None:
    if Trait.INVOLUTION in op.opdef.traits:
        inner = getattr(op._operands[0], "op", None)
        if inner is not None and inner.name == op.name:
            _forward(op, rw, inner._operands[0])


@pattern()
def same_type_noop(op: Operation, rw: PatternRewriter) -> None:
    if Trait.SAME_TYPE_NOOP in op.opdef.traits:
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


@pattern("llm.concat")
def single_concat(op: Operation, rw: PatternRewriter) -> None:
    if len(op._operands) == 1:
        _forward(op, rw, op._operands[0])


def _is_constant(v: Value) -> bool:
    op = getattr(v, "op", None)
    return op is not None and Trait.CONSTANT_LIKE in op.opdef.traits


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
    identity_element,
    involution,
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
