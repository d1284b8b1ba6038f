"""``fold-constants``: evaluate ops whose inputs are all constants, with the op-table kernels.

An llm op is folded when it is pure, every operand comes from ``builtin.constant``, its
attributes and result types are static and its results hold at most ``max_elements`` elements
(so a ``full`` of a huge shape stays a cheap op instead of becoming a huge constant). Program
order makes chains fold in one sweep; constants left without users are erased. A kernel that
fails on its constants leaves the op alone (the interpreter reports it at run time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...types import TensorType
from ..attributes import DenseAttr
from ..builder import Builder
from ..core import Operation
from ..interpreter import run_ops
from ..pass_manager import Pass, register_pass
from ..program import Program
from ..rewriter import is_pure


def foldable(op: Operation, max_elements: int) -> bool:
    if op.opdef.spec is None or not is_pure(op) or op.regions:
        return False
    for v in op._operands:
        owner = getattr(v, "op", None)
        if owner is None or owner.name != "builtin.constant":
            return False
    if any(a.symbolic for a in op.attributes.values()):
        return False
    total = 0
    for r in op.results:
        t = r.type
        if not isinstance(t, TensorType) or not t.is_static:
            return False
        total += math.prod(t.shape)
    return total <= max_elements


def fold_op(op: Operation) -> bool:
    """Replace ``op`` by constants; False (IR untouched) when its kernel fails."""
    values = {v: v.op.attributes["value"].value for v in op._operands}  # type: ignore[attr-defined]
    try:
        with np.errstate(all="ignore"):
            run_ops([op], values)
    except Exception:
        return False
    b = Builder.before_op(op)
    for r in op.results:
        c = b.create("builtin.constant", (), {"value": DenseAttr(values[r])}, names=[r.name])
        r.replace_all_uses_with(c.results[0])
    producers = [v.op for v in op._operands]  # type: ignore[attr-defined]
    op.erase()
    for p in producers:
        if p.parent is not None and not p.results[0].has_uses:
            p.erase()
    return True


@register_pass
@dataclass
class FoldConstants(Pass):
    name = "fold-constants"
    max_elements: int = 1024  # larger results are not materialized as constants

    def apply(self, program: Program) -> None:
        for op in list(program.walk()):
            if op.parent is not None and foldable(op, self.max_elements):
                fold_op(op)
