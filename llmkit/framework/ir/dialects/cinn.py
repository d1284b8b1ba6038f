"""``cinn``: fusion groups and compiled kernels (shells the compiler issue fills in).

``cinn.fusion`` holds a single-block region of (fusible) ops that may use any value visible at
the fusion op; it ends with ``cinn.yield``, whose operands become the fusion's results.
``cinn.kernel`` calls a compiled kernel (by its ``kernel`` name) on its operands; its result types
are given explicitly.
"""

from __future__ import annotations

from ...opspec import Trait
from ..attributes import StrAttr
from ..core import Operation
from ..opdef import Dialect, OpDef, OpView, any_attr, is_a, must_end

T = Trait


def _verify_fusion(op: Operation) -> str | None:
    if len(op.regions[0].blocks) != 1:
        return "a fusion group has exactly one block"
    body = op.regions[0].blocks[0]
    if body.args:
        return "a fusion group's block takes no arguments (its ops use outer values directly)"
    y = body.last
    if y is None or y.name != "cinn.yield":
        return None  # the missing terminator is reported by the generic check
    got = [v.type for v in y.operands]
    want = [r.type for r in op.results]
    if got != want:
        shown = ", ".join(map(str, got)), ", ".join(map(str, want))
        return f"cinn.yield gives ({shown[0]}) but the fusion returns ({shown[1]})"
    return None


FUSION = OpDef(
    "cinn.fusion",
    frozenset({T.RECURSIVELY_PURE}),
    max_operands=None,  # the outside values its region reads: what a compiled kernel receives
    num_results=None,
    num_regions=1,
    optional_attrs={"*": any_attr},
    verify=_verify_fusion,
    doc="A fusion group: a region of ops compiled into one kernel; results are yielded.",
)
YIELD = OpDef(
    "cinn.yield",
    frozenset({T.TERMINATOR, T.PURE}),
    max_operands=None,
    num_results=0,
    verify=must_end("cinn.fusion"),
    doc="Ends a fusion group, giving its results.",
)
KERNEL = OpDef(
    "cinn.kernel",
    frozenset({T.PURE}),
    max_operands=None,
    num_results=None,
    attrs={"kernel": is_a(StrAttr)},
    optional_attrs={"*": any_attr},
    doc="Runs the compiled kernel named by `kernel` on its operands.",
)

DIALECT = Dialect("cinn", [FUSION, YIELD, KERNEL], doc=__doc__ or "")


class FusionOp(OpView):
    __slots__ = ()
    OP_NAME = "cinn.fusion"

    @property
    def yield_op(self) -> Operation | None:
        last = self.body.last
        return last if last is not None and last.name == "cinn.yield" else None
