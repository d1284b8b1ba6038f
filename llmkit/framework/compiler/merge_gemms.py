"""``merge-gemms``: the products of a training step that share an input become one wider GEMM each.

A Llama layer multiplies the same normalized hidden states by three weights (q, k and v
projections) and by two more (the MLP's gate and up). Where a program holds such linears and their
backward (a training step), each set runs as one product, forward and backward:

* forward: ``y = x @ concat(W_i).T``, each ``y_i`` a slice of its columns (a view);
* input gradient: ``sum_i g_i @ W_i`` (that many GEMMs and the adds between them) becomes
  ``concat(g_i) @ concat(W_i)``, one GEMM over the concatenated gradients;
* weight gradients: ``g_i.T @ x`` become ``concat(g_i).T @ x``, each ``dW_i`` a block of its rows.

The parameters stay the separate tensors the optimizer and checkpoints see: the weights are
concatenated afresh in every step (a copy of the weights alone, small beside the products). A wider
GEMM keeps BLAS's threads on fewer, larger pieces of work; the input gradient sums inside the
GEMM instead of in separate adds. The sums run in another order, so the results agree with the
separate products to float32 rounding. Linears without that backward (inference programs) are left
as they are, and so is a set whose pattern differs in any way.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

from ..ir import Builder, Operation, Pass, Program, Value, register_pass
from ..ir.core import OpResult

# LLMKIT_MERGE_GEMMS=0 turns the pass off (benchmarks time both ways in one run)
enabled = os.environ.get("LLMKIT_MERGE_GEMMS", "1") != "0"


def _producer(v: Value, name: str) -> Operation | None:
    op = v.op if isinstance(v, OpResult) else None
    return op if op is not None and op.name == name else None


def _plain_matmul(op: Operation, tx: bool) -> bool:
    a = op.plain_attrs
    return op.name == "llm.matmul" and bool(a.get("transpose_x")) == tx and not a.get("transpose_y")


def _flat_of(v: Value, x: Value) -> bool:
    """``v`` is ``x`` or ``reshape(x, [-1, K])`` (the weight gradient's flattened operand)."""
    r = _producer(v, "llm.reshape")
    return v is x or (r is not None and r.operands[0] is x and v.ndim == 2)


def _backward(lin: Operation) -> tuple[Operation, Operation] | None:
    """(``g @ W``, ``flat(g).T @ flat(x)``) of linear ``lin`` = x @ W.T: the products its vjp made,
    found through the weight and paired through the same output gradient ``g``."""
    x, w = lin.operands
    for dx in w.users:
        if not _plain_matmul(dx, False) or dx.operands[1] is not w:
            continue
        g = dx.operands[0]
        if g.type != lin.result.type:
            continue
        for r in g.users:
            if r.name != "llm.reshape" or r.result.ndim != 2:
                continue
            for dw in r.result.users:
                ok = _plain_matmul(dw, True) and dw.operands[0] is r.result and dw.result.type == w.type
                if ok and _flat_of(dw.operands[1], x):
                    return dx, dw
    return None


def _sum_tree(terms: list[Value]) -> tuple[Operation, list[Operation]] | None:
    """The ``add`` that sums exactly ``terms`` (each used by that sum alone), and the adds of it."""
    live, adds = set(terms), []
    while len(live) > 1:
        for v in list(live):
            if v not in live or len(v.uses) != 1:
                continue
            op = v.users[0]
            if op.name != "llm.add" or op.operands[0] is op.operands[1]:
                return None
            if all(o in live for o in op.operands):
                if op.result.type != v.type:
                    return None
                live.difference_update(op.operands)
                live.add(op.result)
                adds.append(op)
                break
        else:
            return None
    return (adds[-1], adds) if adds else None


def _merge(lins: list[Operation], pos: dict[Operation, int]) -> bool:
    """Rewrite one set of linears of a shared input with their backward (see the module docstring)."""
    found = [_backward(lin) for lin in lins]
    if any(f is None for f in found):
        return False
    dxs = [f[0] for f in found]
    tree = _sum_tree([d.result for d in dxs])
    if tree is None:
        return False
    root, adds = tree
    x = lins[0].operands[0]
    first = min(lins, key=pos.__getitem__)
    ws = [lin.operands[1] for lin in lins]
    if any(isinstance(w, OpResult) and pos.get(w.op, len(pos)) > pos[first] for w in ws):
        return False
    widths = [w.shape[0] for w in ws]
    offs = [sum(widths[:i]) for i in range(len(widths) + 1)]
    b = Builder.before_op(first)
    wc = b.llm.concat(ws, axis=0)
    y = b.llm.linear(x, wc)
    for lin, lo, hi in zip(lins, offs, offs[1:]):
        lin.result.replace_all_uses_with(b.llm.slice(y, axes=[-1], starts=[lo], ends=[hi]))
    for lin in lins:
        lin.erase()
    b = Builder.before_op(root)
    gc = b.llm.concat([d.operands[0] for d in dxs], axis=-1)
    root.result.replace_all_uses_with(b.llm.matmul(gc, wc))
    k = ws[0].shape[1]
    dwc = b.llm.matmul(
        b.llm.reshape(gc, shape=[-1, offs[-1]]), b.llm.reshape(x, shape=[-1, k]), transpose_x=True
    )
    for (_, dw), lo, hi in zip(found, offs, offs[1:]):
        dw.result.replace_all_uses_with(b.llm.slice(dwc, axes=[0], starts=[lo], ends=[hi]))
    for op in [*(dw for _, dw in found), *reversed(adds), *dxs]:
        op.erase()
    return True


def merge_gemms(program: Program) -> int:
    """Merge every set of linears (no bias) of one input whose backward is in the program; returns
    how many sets were merged."""
    n = 0
    for f in program.functions.values():
        block = f.body
        pos = {op: i for i, op in enumerate(block)}
        sets: dict[Value, list[Operation]] = defaultdict(list)
        for op in block:
            if op.name == "llm.linear" and len(op.operands) == 2 and op.operands[1].ndim == 2:
                sets[op.operands[0]].append(op)
        for lins in sets.values():
            weights = {lin.operands[1] for lin in lins}
            if len(lins) < 2 or len(weights) != len(lins) or len({w.type.dtype for w in weights}) != 1:
                continue
            n += _merge(lins, pos)
    return n


@register_pass
@dataclass
class MergeGemms(Pass):
    """``merge-gemms``: :func:`merge_gemms` (before ``decompose``); off with LLMKIT_MERGE_GEMMS=0."""

    name = "merge-gemms"

    def apply(self, program: Program) -> None:
        if enabled:
            merge_gemms(program)
