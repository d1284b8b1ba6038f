"""``fuse-patterns``: fusion rules written with DRR.

- ``matmul_t_add_to_linear``: ``matmul(x, w, transpose_y=true) + b`` -> ``linear(x, w, b)``
- ``matmul_add_to_linear``: ``matmul(x, w) + b`` -> ``linear(x, transpose(w, [1, 0]), b)``
- ``silu_mul_to_swiglu``: ``silu(a) * b`` -> ``swiglu(a, b)``

Each needs: a 2-D weight and a 1-D bias of the output width (the linear layout), or gate and up
of one shape (a fused kernel does not broadcast); the intermediate must have no other user (the
DRR match checks that). Both orders of the commutative add/mul match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import drr
from ..pass_manager import Pass, register_pass
from ..program import Program
from ..rewriter import apply_patterns


def _bias_fits(m: drr.Match) -> bool:
    w, b = m["w"], m["b"]
    return w.ndim == 2 and b.ndim == 1 and b.dtype == w.dtype


def _bias_is_rows(m: drr.Match) -> bool:  # w is [out, in]: the bias has `out` entries
    return _bias_fits(m) and m["b"].shape[0] == m["w"].shape[0]


def _bias_is_cols(m: drr.Match) -> bool:  # w is [in, out]
    return _bias_fits(m) and m["b"].shape[0] == m["w"].shape[1]


MATMUL_T_ADD_TO_LINEAR = drr.Rule(
    "matmul_t_add_to_linear",
    source=[
        drr.op("llm.matmul", ["x", "w"], ["mm"], transpose_x=False, transpose_y=True),
        drr.op("llm.add", ["mm", "b"], ["out"]),
    ],
    constraints=[_bias_is_rows],
    result=[drr.op("llm.linear", ["x", "w", "b"], ["out"])],
)

MATMUL_ADD_TO_LINEAR = drr.Rule(
    "matmul_add_to_linear",
    source=[
        drr.op("llm.matmul", ["x", "w"], ["mm"], transpose_x=False, transpose_y=False),
        drr.op("llm.add", ["mm", "b"], ["out"]),
    ],
    constraints=[_bias_is_cols],
    result=[
        drr.op("llm.transpose", ["w"], ["wt"], perm=[1, 0]),
        drr.op("llm.linear", ["x", "wt", "b"], ["out"]),
    ],
)

SILU_MUL_TO_SWIGLU = drr.Rule(
    "silu_mul_to_swiglu",
    source=[drr.op("llm.silu", ["a"], ["s"]), drr.op("llm.mul", ["s", "b"], ["out"])],
    constraints=[lambda m: m["a"].shape == m["b"].shape],
    result=[drr.op("llm.swiglu", ["a", "b"], ["out"])],
)

RULES: dict[str, drr.Rule] = {
    r.name: r for r in (MATMUL_T_ADD_TO_LINEAR, MATMUL_ADD_TO_LINEAR, SILU_MUL_TO_SWIGLU)
}


@register_pass
@dataclass
class FusePatterns(Pass):
    name = "fuse-patterns"
    rules: list[str] = field(default_factory=lambda: list(RULES))  # which rules to apply

    def apply(self, program: Program) -> None:
        apply_patterns(program, [RULES[r] for r in self.rules], erase_dead=False)  # fusing is its one job
