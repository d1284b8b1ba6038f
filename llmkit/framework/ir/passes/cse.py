"""``cse``: merge pure operations that compute the same thing.

Two ops are equal when they have the same name, operands (in either order for commutative ops),
attributes and result types, and no regions. A scoped hash table walks each function in program
order: an op nested in a fusion group may reuse an equal op defined before the group, never the
other way round, so dominance is kept. Linear in the program size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...opspec import Trait
from ..core import Block, Operation
from ..pass_manager import Pass, register_pass
from ..program import Program


def _key(op: Operation) -> Any:
    operands = tuple(id(v) for v in op._operands)
    if len(operands) == 2 and Trait.COMMUTATIVE in op.opdef.traits and operands[0] > operands[1]:
        operands = operands[::-1]
    attrs = frozenset(op.attributes.items()) if op.attributes else None
    return (op.name, operands, attrs, tuple(r.type for r in op.results))


def cse_block(block: Block, table: dict[Any, Operation]) -> int:
    """Merge duplicates in ``block`` (and nested blocks) given the ops known from outer scopes."""
    n = 0
    added: list[Any] = []
    for op in block:
        if op.regions:
            for r in op.regions:
                for b in r.blocks:
                    n += cse_block(b, {} if Trait.ISOLATED in op.opdef.traits else table)
            continue
        if not op.results or Trait.PURE not in op.opdef.traits:
            continue
        key = _key(op)
        prev = table.get(key)
        if prev is None:
            table[key] = op
            added.append(key)
            continue
        for old, new in zip(op.results, prev.results, strict=False):
            old.replace_all_uses_with(new)
        op.erase()
        n += 1
    for key in added:  # values of this block are not visible after it
        del table[key]
    return n


@register_pass
@dataclass
class CSE(Pass):
    name = "cse"

    def apply(self, program: Program) -> None:
        for f in program.functions.values():
            cse_block(f.body, {})
