"""``dce``: erase pure operations none of whose results is used.

One backward sweep per block: a dead op is erased before its producers are visited, so whole
dead chains go in a single linear pass. Nested regions are swept first; a fusion group whose
results are all unused goes as a whole. Impure ops (communication) and terminators stay.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import Block
from ..pass_manager import Pass, register_pass
from ..program import Program
from ..rewriter import is_trivially_dead


def dce_block(block: Block) -> int:
    """Erase the dead ops of ``block`` (and of blocks nested in it); returns how many."""
    n = 0
    for op in block.reversed():
        if is_trivially_dead(op):
            n += sum(1 for _ in op.walk())
            op.erase()
            continue
        for r in op.regions:
            for b in r.blocks:
                n += dce_block(b)
    return n


@register_pass
@dataclass
class DCE(Pass):
    name = "dce"

    def apply(self, program: Program) -> None:
        for f in program.functions.values():
            dce_block(f.body)
