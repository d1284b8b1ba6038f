"""Program autodiff: ``append_backward(program, loss, wrt)`` on an existing PIR function.

Traced training steps get their backward from the eager tape already (``loss.backward()`` under
tracing). This entry point differentiates a program given as IR (parsed from text, or built with a
Builder): it replays the function's ops onto autograd nodes whose tensors hold the PIR values, and
runs the same ``run_backward`` with the same vjp rules, inside a trace that inserts the gradient
ops before the function's return. Values used several times get their gradients summed there.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..autograd import run_backward
from ..dispatch import O
from ..ir import Builder, Program, Value
from ..tape import Node
from ..tensor import Tensor
from ..tracer import Trace, TraceError, tracing


def append_backward(
    program: Program, loss: Value, wrt: Sequence[Value], func: str | None = None, return_grads: bool = True
) -> list[Value]:
    """Append d(loss)/d(w) for each ``w`` in ``wrt`` to function ``func``; returns the gradient values.

    ``loss`` must be a scalar result of the function. With ``return_grads`` the gradients are
    appended to the function's outputs. Inputs the loss does not depend on get zeros.
    """
    f = program.function(func)
    ret = f.return_op
    if ret is None:
        raise TraceError(f"append_backward: @{f.name} has no return op")
    if loss.type.shape != ():
        raise TraceError(f"append_backward: the loss must be a scalar, got {loss.type}")
    wanted = {id(w) for w in wrt}
    tensors: dict[Value, Tensor] = {}

    def tensor(v: Value) -> Tensor:
        t = tensors.get(v)
        if t is None:
            t = tensors[v] = Tensor._wrap(v)
            t.requires_grad = id(v) in wanted
        return t

    for w in wrt:
        tensor(w)
    for op in f.body:
        spec = op.opdef.spec
        if spec is None:
            continue
        ins = tuple(tensor(v) for v in op.operands)
        outs = [tensor(r) for r in op.results]
        if spec.vjp is None or not any(x.requires_grad for i, x in enumerate(ins) if i not in spec.nondiff):
            continue
        node = Node(spec, ins, dict(op.plain_attrs), tuple(Tensor._wrap(r) for r in op.results))
        for i, t in enumerate(outs):
            t.requires_grad, t._node, t._out_idx = True, node, i
    root = tensor(loss)
    if not root.requires_grad:
        raise TraceError("append_backward: the loss does not depend on any of the wrt values")
    trace = Trace(program, f.name, builder=Builder.before_op(ret))
    with tracing(trace):
        grads = run_backward([root], [O.ones_like(root)], capture=[tensors[w] for w in wrt])
        out = [g._data if g is not None else O.zeros_like(tensors[w])._data for g, w in zip(grads, wrt)]
    if return_grads:
        ret.set_operands([*ret.operands, *out])
    return out
