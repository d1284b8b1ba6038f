"""Reverse-mode autodiff on the tape of op applications (``tape.py``).

Every differentiable op application made while gradients are enabled records a ``Node`` (its op
spec, input tensors, attributes and outputs). ``backward`` walks the nodes in reverse
topological order and calls each op's ``vjp`` rule. Rules are written with ops, so the same walk
builds the backward program when the tensors are tracer values (program autodiff), and builds a
differentiable graph when ``create_graph`` is set (higher-order gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .dispatch import O
from .tape import Node, is_grad_enabled, no_grad, set_grad_enabled
from .tensor import Tensor


def sum_to(g: Tensor, shape: Sequence) -> Tensor:
    """Sum a broadcast gradient back to ``shape`` (the adjoint of broadcasting)."""
    gshape = tuple(g.shape)
    shape = tuple(shape)
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    axes = list(range(lead)) + [i + lead for i, d in enumerate(shape) if d == 1 and gshape[i + lead] != 1]
    if axes:
        g = O.sum(g, axis=axes, keepdim=True)
    return O.reshape(g, shape) if tuple(g.shape) != shape else g


def _topo(roots: Iterable[Tensor]) -> list[Node]:
    """Nodes reachable from the roots, each after every node that consumes its outputs."""
    order: list[Node] = []
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(r._node, False) for r in roots if r._node is not None]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for x in node.inputs:
            n = x._node
            if n is not None and id(n) not in seen:
                stack.append((n, False))
    order.reverse()
    return order


def run_backward(
    roots: Sequence[Tensor],
    root_grads: Sequence[Tensor],
    *,
    retain_graph: bool = False,
    create_graph: bool = False,
    capture: Sequence[Tensor] | None = None,
    defer: Callable[[Tensor], bool] | None = None,
) -> Any:
    """Propagate ``root_grads`` from ``roots`` to every tensor that requires grad.

    Without ``capture``, gradients accumulate into the ``.grad`` of leaf tensors. With it, the
    gradients of exactly those tensors (leaves or not) are returned and no ``.grad`` changes.
    With ``defer``, the gradients of the leaves it accepts (a pipeline's weights) are neither
    computed nor accumulated: they are returned, as the vjp rules' thunks where the rules give
    them, for :func:`accumulate_deferred` to finish later (zero-bubble pipelines run the input
    gradients first and the weight gradients when a rank would otherwise wait).
    """
    # Gradients waiting for a node: node id -> [grad per output].
    pending: dict[int, list[Any]] = {}
    want: dict[int, int] = {}  # capture: id(tensor) or (node id, out index) -> result slot
    got: list[Tensor | None] = [None] * len(capture or ())
    deferred: list[tuple[Tensor, Any]] = []
    for i, t in enumerate(capture or ()):
        want[id(t) if t._node is None else (id(t._node), t._out_idx)] = i

    def accumulate(t: Tensor, g: Tensor) -> None:
        if t._node is None:
            if capture is not None:
                slot = want.get(id(t))
                if slot is not None:
                    got[slot] = g if got[slot] is None else got[slot] + g
            elif t.requires_grad:
                _into_grad(t, g, create_graph)
            return
        slots = pending.setdefault(id(t._node), [None] * max(1, len(t._node.outputs)))
        idx = t._out_idx
        slots[idx] = g if slots[idx] is None else slots[idx] + g

    for r, g in zip(roots, root_grads):
        if not r.requires_grad:
            raise RuntimeError(
                "backward: a tensor does not require grad and has no grad_fn; "
                "did you compute it under no_grad() or from tensors with requires_grad=False?"
            )
        accumulate(r, g)

    with set_grad_enabled(create_graph):
        for node in _topo(roots):
            gs = pending.pop(id(node), None)
            if gs is None:
                continue
            if node.freed:
                raise RuntimeError(
                    f"backward through {node.spec.name} a second time: its saved tensors were freed. "
                    "Pass retain_graph=True to the first backward if you need to go through the graph twice."
                )
            for idx, g in enumerate(gs):
                slot = want.get((id(node), idx))
                if slot is not None and g is not None:
                    got[slot] = g
            spec = node.spec
            if spec.multi_output:
                g = tuple(gi if gi is not None else O.zeros_like(o) for gi, o in zip(gs, node.outputs))
                out: Any = node.outputs
            else:
                g, out = gs[0], node.outputs[0]
            grads = spec.vjp(g, out, *node.inputs, **node.attrs)
            if len(grads) < len(node.inputs):  # rules may list omitted optional inputs too
                raise RuntimeError(
                    f"vjp rule of {spec.name} returned {len(grads)} gradients for {len(node.inputs)} inputs"
                )
            for i, (x, gx) in enumerate(zip(node.inputs, grads)):
                if gx is None or i in spec.nondiff or not x.requires_grad:
                    continue
                if defer is not None and x._node is None and defer(x):
                    deferred.append((x, (spec.name, i, gx)))
                    continue
                accumulate(x, _checked(spec.name, i, gx, x))
            if not retain_graph:
                node.free()
    if defer is not None:
        return deferred
    return got if capture is not None else None


def _checked(op: str, i: int, gx: Any, x: Tensor) -> Tensor:
    """A vjp rule's gradient for input ``i`` of ``op``: computed if a thunk, summed to x's shape."""
    if not isinstance(gx, Tensor):
        gx = gx()  # a thunk: computed only for inputs that need it
    if gx.dtype != x.dtype:
        raise RuntimeError(f"vjp rule of {op} gave a {gx.dtype} gradient for a {x.dtype} input {i}")
    return sum_to(gx, x.shape)


def _into_grad(t: Tensor, g: Tensor, create_graph: bool = False) -> None:
    g = g if create_graph else g.detach()
    t.grad = g if t.grad is None else (t.grad + g if create_graph else (t.grad + g).detach())


def accumulate_deferred(deferred: Sequence[tuple[Tensor, Any]]) -> None:
    """Finish what ``run_backward(..., defer=...)`` left: compute each deferred gradient and add it
    to its leaf's ``.grad``."""
    with no_grad():
        for t, (op, i, gx) in deferred:
            _into_grad(t, _checked(op, i, gx, t))


def backward(
    tensor: Tensor, grad: Tensor | None = None, retain_graph: bool = False, create_graph: bool = False
) -> None:
    """Accumulate d(tensor)/d(leaf) into every leaf's ``.grad``; ``grad`` defaults to 1 for scalars."""
    run_backward([tensor], [_seed_grad(tensor, grad)], retain_graph=retain_graph, create_graph=create_graph)


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    grad_outputs: Tensor | Sequence[Tensor | None] | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
) -> tuple[Tensor | None, ...]:
    """Gradients of ``outputs`` with respect to ``inputs`` (functional; ``.grad`` is untouched).

    An input that the outputs do not depend on raises unless ``allow_unused`` (then it gets None).
    """
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    ins = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if grad_outputs is None or isinstance(grad_outputs, Tensor):
        gos: list[Any] = [grad_outputs] * len(outs) if grad_outputs is None else [grad_outputs]
    else:
        gos = list(grad_outputs)
    seeds = [_seed_grad(o, g) for o, g in zip(outs, gos)]
    got = run_backward(
        outs,
        seeds,
        retain_graph=create_graph if retain_graph is None else retain_graph,
        create_graph=create_graph,
        capture=ins,
    )
    assert got is not None
    for i, g in enumerate(got):
        if g is None and not allow_unused:
            raise RuntimeError(
                f"grad: input {i} was not used to compute the outputs; pass allow_unused=True to get None"
            )
    return tuple(got)


def _seed_grad(t: Tensor, g: Tensor | None) -> Tensor:
    if g is not None:
        if tuple(g.shape) != tuple(t.shape):
            raise ValueError(
                f"backward: grad shape {list(g.shape)} does not match tensor shape {list(t.shape)}"
            )
        return g
    if any(d != 1 for d in t.shape):
        raise RuntimeError(
            f"backward: grad can be created implicitly only for scalar outputs, got shape {list(t.shape)}; "
            "pass grad=..."
        )
    return O.ones_like(t)


class _SegmentSpec:
    """The tape entry of a recomputed segment: its vjp re-runs the segment, then differentiates it."""

    name = "recompute"
    nondiff: frozenset[int] = frozenset()

    def __init__(self, fn, args: tuple, n_tensors: int, kwargs: dict, multi: bool) -> None:
        self.fn, self.args, self.n_tensors, self.kwargs, self.multi_output = (
            fn,
            args,
            n_tensors,
            kwargs,
            multi,
        )

    def vjp(self, g, out, *inputs):
        fresh = iter(x.detach().requires_grad_(x.requires_grad) for x in inputs[: self.n_tensors])
        tensors: list[Tensor] = []
        call_args = []
        for a in self.args:
            if isinstance(a, Tensor):
                a = next(fresh)
                tensors.append(a)
            call_args.append(a)
        params = list(inputs[self.n_tensors :])
        with set_grad_enabled(True):
            again = self.fn(*call_args, **self.kwargs)
        outs = list(again) if isinstance(again, (tuple, list)) else [again]
        gs = list(g) if self.multi_output else [g]
        keep = [(o, gi) for o, gi in zip(outs, gs) if o.requires_grad]
        everything = tensors + params
        wrt = [t for t in everything if t.requires_grad]
        if not keep or not wrt:
            return (None,) * len(inputs)
        got = iter(run_backward([o for o, _ in keep], [gi for _, gi in keep], capture=wrt))
        return tuple(next(got) if t.requires_grad else None for t in everything)


def checkpoint(fn, *args: Any, params: Sequence[Tensor] = (), **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; backward recomputes them.

    ``params`` are the tensors ``fn`` reads besides its arguments (a layer's parameters), so their
    gradients flow too. Under tracing, this makes the backward program recompute the segment's
    forward ops, and the forward activations die right after their last forward use.
    The segment must be deterministic (no dropout drawing fresh seeds).
    """
    with no_grad():
        out = fn(*args, **kwargs)
    tensor_args = [a for a in args if isinstance(a, Tensor)]
    inputs = (*tensor_args, *params)
    if not is_grad_enabled() or not any(t.requires_grad for t in inputs):
        return out
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    spec = _SegmentSpec(fn, args, len(tensor_args), kwargs, multi=isinstance(out, (tuple, list)))
    node = Node(spec, inputs, {}, tuple(Tensor._wrap(o._data) for o in outs))
    for i, o in enumerate(outs):
        o.requires_grad, o._node, o._out_idx = True, node, i
    return out


def saved_bytes(roots: Sequence[Tensor]) -> int:
    """Bytes of the distinct buffers the tape keeps for the backward of ``roots`` (every node's
    inputs and outputs), leaves (parameters, the batch, buffers) excluded: the activation memory
    when the forward ends, the eager step's peak. A view shares its base's buffer, counted once. For
    distributed tensors, the fullest rank's bytes."""
    leaves: set[int] = set()
    held: dict[Any, dict[int, int]] = {}  # rank -> buffer id -> bytes

    def buffers(t: Tensor):
        d = t._data
        for rank, a in getattr(d, "shards", {None: d}).items():
            while getattr(a, "base", None) is not None:
                a = a.base
            if hasattr(a, "nbytes"):
                yield rank, a

    for node in _topo(roots):
        for x in node.inputs:
            if x._node is None:
                leaves.update(id(a) for _, a in buffers(x))
        for x in (*node.inputs, *node.outputs):
            for rank, a in buffers(x):
                held.setdefault(rank, {})[id(a)] = a.nbytes
    return max((sum(n for i, n in h.items() if i not in leaves) for h in held.values()), default=0)
