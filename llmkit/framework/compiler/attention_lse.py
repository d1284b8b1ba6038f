"""``attention-lse``: an attention forward and the backward of its output share the log-sum-exp.

Where a program holds both (every training step), the flash kernels (``native/attention.py``)
pass each query row's log-sum-exp from the forward to the backward instead of recomputing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Builder, Pass, Program, register_pass
from ..ir.core import OpResult
from .native import native_of


def keep_attention_lse(program: Program) -> int:
    """Pair each attention backward with its forward: where ``scaled_dot_product_attention_grad``
    (no mask, run by its hand-written kernel) differentiates the output of a
    ``scaled_dot_product_attention`` of the same q, k, v and attributes, both become the ``_lse``
    forms: the forward also returns each row's log-sum-exp, and the backward takes it instead of
    recomputing it (a pass over every key, about a fifth of the backward). Returns the pairs."""
    n = 0
    for f in program.functions.values():
        for grad in list(f.body):
            if grad.name != "llm.scaled_dot_product_attention_grad" or native_of(grad) is None:
                continue
            out = grad.operands[1]
            fwd = out.op if isinstance(out, OpResult) else None
            if (
                fwd is None
                or fwd.name != "llm.scaled_dot_product_attention"
                or native_of(fwd) is None
                or list(fwd.operands) != list(grad.operands[2:5])
                or fwd.plain_attrs != grad.plain_attrs
            ):
                continue
            attrs = dict(fwd.plain_attrs)
            pair = Builder.before_op(fwd).create(
                "scaled_dot_product_attention_lse", list(fwd.operands), attrs
            )
            fwd.results[0].replace_all_uses_with(pair.results[0])
            fwd.erase()
            g, _, q, k, v = grad.operands
            new = Builder.before_op(grad).create(
                "scaled_dot_product_attention_lse_grad", [g, pair.results[0], pair.results[1], q, k, v], attrs
            )
            for old, r in zip(grad.results, new.results):
                old.replace_all_uses_with(r)
            grad.erase()
            n += 1
    return n


@register_pass
@dataclass
class AttentionLse(Pass):
    """``attention-lse``: :func:`keep_attention_lse` (before ``decompose``)."""

    name = "attention-lse"

    def apply(self, program: Program) -> None:
        keep_attention_lse(program)
