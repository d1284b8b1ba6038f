"""``quantize-linear``: a linear whose weight is quantized becomes one ``quant_linear``.

A model with quantized layers (``nn.QuantizedLinear``) traces to ``linear(x, dequantize(q, s, z))``:
correct, but the float weight is made at every call. The rules below (DRR) rewrite

    linear(x, dequantize(q, s[, z]) [, b])                          -> quant_linear(x, q, s[, z]) [+ b]
    tiled_linear{rows}(x, dequantize(q, s[, z]) [, b])              -> quant_linear{rows}(x, q, s[, z]) [+ b]

so the program reads only the codes (a quarter or an eighth of the bytes), and the engine's
batch-invariant tiles (``rows``) carry over. ``tiled_linear`` weights already relaid
(``transposed``, ``panel``) are not dequantized weights and never match. A ``dequantize`` with other
users stays for them (the DRR match requires the intermediate to have no other user).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import drr
from ..pass_manager import Pass, register_pass
from ..program import Program
from ..rewriter import apply_patterns


def _rule(linear: str, zeros: bool, bias: bool) -> drr.Rule:
    q = ["q", "s", "z"] if zeros else ["q", "s"]
    b = ["b"] if bias else []
    tiled = linear == "llm.tiled_linear"
    layout = {"rows": drr.Attr("rows"), "transposed": False, "panel": 0} if tiled else {}
    fmt = {"bits": drr.Attr("bits"), "group_size": drr.Attr("group_size")}
    rows = drr.Attr("rows") if tiled else 0
    y = "y" if bias else "out"
    result = [drr.op("llm.quant_linear", ["x", *q], [y], **fmt, rows=rows)]
    if bias:
        result.append(drr.op("llm.add", ["y", "b"], ["out"]))
    return drr.Rule(
        f"{linear.removeprefix('llm.')}_dequantize{'_zeros' if zeros else ''}{'_bias' if bias else ''}",
        source=[drr.op("llm.dequantize", q, ["w"], **fmt), drr.op(linear, ["x", "w", *b], ["out"], **layout)],
        result=result,
    )


RULES = [
    _rule(linear, zeros, bias)
    for linear in ("llm.linear", "llm.tiled_linear")
    for zeros in (False, True)
    for bias in (False, True)
]


@register_pass
@dataclass
class QuantizeLinear(Pass):
    name = "quantize-linear"

    def apply(self, program: Program) -> None:
        apply_patterns(program, RULES, erase_dead=False)  # its one job
