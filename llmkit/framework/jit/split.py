"""Split a function into phases by its outputs: ``split_phases(program, [[0], [1], [2, 3]])``.

Phase ``k`` computes the outputs listed in ``phases[k]`` with the ops they need that no earlier
phase ran. A value one phase computes and a later one reads is a *residual*: an output of the
first, an input of the second. A traced training step of a pipeline stage (forward, backward,
weight gradients in one program, autodiff's saved activations connecting them) becomes the
programs of its F, B and W jobs this way; the residuals are what a micro-batch holds between them
(PaddlePaddle's static pipeline splits its programs by op role the same way). Ops without operands
(constants, ``arange``) are copied into every phase that reads them, never held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..ir import Builder, Operation, Program, Value

ARG, RES, OUT = "arg", "res", "out"


@dataclass
class Phase:
    """One phase's program; ``inputs``: for each of its inputs, ``("arg", i)`` (the function's
    input i) or ``("res", k)`` (residual k); ``outputs``: ``("out", j)`` or ``("res", k)``."""

    program: Program
    inputs: list[tuple[str, int]]
    outputs: list[tuple[str, int]]


def split_phases(program: Program, phases: Sequence[Sequence[int]], func: str | None = None) -> list[Phase]:
    f = program.function(func)
    body = [op for op in f.body if op.name != "builtin.return"]
    order = {op: i for i, op in enumerate(body)}
    outputs = list(f.outputs)
    args = {v: i for i, v in enumerate(f.args)}
    owner: dict[Operation, int] = {}  # op -> the phase running it
    free = {op for op in body if not op.operands}  # copied wherever needed

    def need(vs: list[Value], k: int) -> None:
        stack = [v.owner for v in vs if v not in args]
        while stack:
            op = stack.pop()
            if op in owner or op in free:
                continue
            owner[op] = k
            stack.extend(v.owner for v in op.operands if v not in args)

    for k, outs in enumerate(phases):
        need([outputs[j] for j in outs], k)
    residual: dict[Value, int] = {}
    out = []
    for k, outs in enumerate(phases):
        ops = sorted((op for op, p in owner.items() if p == k), key=order.__getitem__)
        mine = set(ops)
        copies: set[Operation] = set()
        ins: list[Value] = []
        for op in ops:
            for v in op.operands:
                src = v.owner if v not in args else None
                if src in free:
                    copies.add(src)
                elif src not in mine and v not in ins:
                    ins.append(v)
        for j in outs:  # an output computed earlier (or an input) passes through
            v = outputs[j]
            if (v in args or v.owner not in mine) and v not in ins:
                if v not in args and v.owner in free:
                    copies.add(v.owner)
                else:
                    ins.append(v)
        later = {v for op, p in owner.items() if p > k for v in op.operands}
        later |= {outputs[j] for outs2 in phases[k + 1 :] for j in outs2}
        held = [r for op in ops for r in op.results if r in later and r not in residual]
        for r in held:
            residual[r] = len(residual)
        g = Program()
        fn = g.add_function("main", [(v.name, v.type) for v in ins])
        env = dict(zip(ins, fn.args))
        b = Builder.at_end(fn.body)
        for op in sorted(copies, key=order.__getitem__) + ops:
            b.insert(op.clone(env))
        b.ret(*[env[outputs[j]] for j in outs], *[env[r] for r in held])
        g.verify()
        out.append(
            Phase(
                g,
                [(ARG, args[v]) if v in args else (RES, residual[v]) for v in ins],
                [(OUT, j) for j in outs] + [(RES, residual[r]) for r in held],
            )
        )
    return out
