"""``decompose``: replace composite ops by the primitives their op-table ``decompose`` builds.

The decomposition is *traced*: ``spec.decompose`` runs on tracer tensors whose builder inserts
before the composite op, so it is the same Python rule eager code could call, and the new ops get
their types from the op table. Decompositions may produce other composites (attention makes a
softmax), so the pass repeats until none is left. Each new op remembers the outermost composite it
came from (``origins``), which names the fusion groups later (``cinn.fusion[rms_norm]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import Builder, Operation, Program
from ..ir.pass_manager import Pass, register_pass
from ..opspec import Trait
from ..tensor import Tensor
from ..tracer import Trace, tracing
from .native import native_of

# dtypes the backends can compute in; ops touching others (bfloat16, float16) stay composite
SUPPORTED_DTYPES = frozenset(
    np.dtype(n) for n in ("float64", "float32", "int64", "int32", "int16", "int8", "uint8", "bool")
)


def supported(op: Operation) -> bool:
    return all(v.type.dtype in SUPPORTED_DTYPES for v in (*op.operands, *op.results))


def decompose_op(op: Operation, origins: dict[Operation, str]) -> bool:
    """Trace ``op``'s decomposition in front of it, rewire its users, erase it. False if it has none."""
    spec = op.opdef.spec
    if spec is None or spec.decompose is None or not supported(op):
        return False
    block = op.parent
    before = op.prev
    func = op
    while func.name != "builtin.func":
        func = func.parent_op
    trace = Trace(
        Program(func.parent.parent.parent), func.attributes["sym_name"].value, builder=Builder.before_op(op)
    )
    with tracing(trace):
        outs = spec.decompose(*[Tensor._wrap(v) for v in op.operands], **op.plain_attrs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    for r, t in zip(op.results, outs):
        new = t._data
        if new.type != r.type:  # a decomposition must give the composite's exact types
            raise TypeError(f"decompose of {op.name} gives {new.type}, expected {r.type}")
        r.replace_all_uses_with(new)
    origin = origins.get(op, spec.name)
    cur = before.next if before is not None else block.first
    while cur is not None and cur is not op:
        origins.setdefault(cur, origin)
        cur = cur.next
    origins.pop(op, None)
    op.erase()
    return True


def detach_constant(op: Operation) -> bool:
    """``zeros_like(x)``/``ones_like(x)`` (a ``splat`` op with an operand) of a static shape ->
    ``full``: the value does not depend on x, and keeping x as an operand would order the constant
    after x — a false dependency that blocks fusion (the loss gradient's seed waits for the loss).
    Shape-only ops (numel) are left to ``simplify-shapes``."""
    spec = op.opdef.spec
    if spec is None or spec.splat is None or not op.operands or Trait.SHAPE_ONLY in op.opdef.traits:
        return False
    t = op.results[0].type
    if not all(isinstance(d, int) for d in t.shape):
        return False
    value = spec.splat(*op.operands, **op.plain_attrs)
    if value is None:
        return False
    attrs = {"shape": list(t.shape), "value": float(value), "dtype": t.dtype}
    new = Builder.before_op(op).create("full", [], attrs).results[0]
    op.results[0].replace_all_uses_with(new)
    op.erase()
    return True


@register_pass
@dataclass
class Decompose(Pass):
    """Replace every composite op (one with a ``decompose`` rule) by primitives, to a fixpoint;
    ops whose hand-written kernel applies (``native/``: flash attention) stay whole."""

    name = "decompose"

    def __post_init__(self) -> None:
        self.origins: dict[Operation, str] = {}  # new op -> the outermost composite it came from

    def apply(self, program: Program) -> None:
        for f in program.functions.values():
            changed = True
            while changed:
                changed = False
                for op in list(f.body):
                    if op.opdef.spec is not None and op.opdef.spec.decompose is not None:
                        if native_of(op) is None:  # a hand-written kernel beats the primitives
                            changed |= decompose_op(op, self.origins)
                    elif detach_constant(op):
                        changed = True
