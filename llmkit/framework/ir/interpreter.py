"""The reference interpreter: runs a function op by op with the op table's numpy kernels.

Slow and simple on purpose — it is the oracle passes are checked against (the fast executor
arrives with ``to_static``). Symbolic dims are bound from the inputs (``symbolic.bind``) and
checked; attributes holding symbolic dims (``reshape`` shapes, ``arange`` bounds) are evaluated
with the bound sizes before the kernel runs; every result is checked against its declared type.
:func:`run_group` runs one ``cinn.fusion`` group the same way, on numpy or cupy arrays: the one
op-by-op fallback of a group without a compiled kernel (the executor's, the compiler's on GPUs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import backend as B
from .. import symbolic as sym
from ..types import TensorType, Type
from .core import Block, Operation, Value
from .errors import IRError
from .printer import format_op
from .program import Program


class InterpretError(IRError):
    """A program that cannot run on the given inputs; the message names the op."""


def interpret(
    program: Program,
    *inputs: Any,
    func: str | None = None,
    params: Mapping[str, Any] | None = None,
    symbols: Mapping[str, int] | None = None,
) -> Any:
    """Run function ``func`` (default: ``main`` or the only one) on numpy ``inputs``.

    ``params`` maps ``builtin.parameter`` names to arrays; ``symbols`` gives sizes of symbols
    the inputs cannot bind on their own (one that only appears as ``B*S``, or only in results).
    Returns the single output array, or a tuple when the function returns zero or several values.
    """
    f = program.function(func)
    run = _Run(params or {})
    run.env.update(symbols or {})
    if len(inputs) != len(f.args):
        raise InterpretError(f"@{f.name} takes {len(f.args)} inputs, got {len(inputs)}")
    whats = [f"input %{a.name or a.index} of @{f.name}" for a in f.args]
    return run.start(f.args, [np.asarray(x) for x in inputs], whats, lambda: run.block(f.body))


def run_group(
    fusion: Operation,
    xp: Any,
    arrays: Sequence[Any],
    kernels: Mapping[Operation, Callable[..., Any]] | None = None,
) -> Any:
    """Run the ops of ``cinn.fusion`` group ``fusion`` one by one on ``arrays`` (its operands,
    numpy or cupy: ``xp`` is their module) with the op-table kernels, or the one ``kernels`` gives
    an op (an executor's hand-written C kernels). Symbols are bound from the operands and every
    result is checked against its type. Returns the output, or a tuple for several."""
    run = _Run({}, xp, kernels)
    whats = [f"operand #{i} of {fusion.name}" for i in range(len(arrays))]
    return run.start(fusion.operands, arrays, whats, lambda: _fusion(run, fusion))


class _Run:
    def __init__(
        self,
        params: Mapping[str, Any],
        xp: Any = np,
        kernels: Mapping[Operation, Callable[..., Any]] | None = None,
    ) -> None:
        self.params = params
        self.xp = xp
        self.kernels = kernels or {}
        self.env: dict[str, int] = {}
        self.values: dict[Value, Any] = {}
        self.pending: list[tuple[Type, tuple, str]] = []

    def start(self, values: Sequence[Value], arrays: Sequence[Any], whats: list[str], body: Callable) -> Any:
        """Bind ``values`` to ``arrays`` (checked against their types), run ``body`` and return its
        output, or a tuple for several."""
        for v, a, what in zip(values, arrays, whats, strict=True):
            self.bind(v.type, a, what)
            self.values[v] = a
        self.check_bound()
        outs = body()
        return outs[0] if len(outs) == 1 else tuple(outs)

    def bind(self, t: Type, arr: np.ndarray, what: str) -> None:
        """Check ``arr`` against type ``t``, binding the symbols it fixes."""
        if arr.dtype != t.dtype:
            raise InterpretError(f"{what}: expected dtype {B.dtype_name(t.dtype)}, got {arr.dtype}")
        shape = t.shape
        if arr.ndim != len(shape):
            raise InterpretError(f"{what}: expected a rank-{len(shape)} array ({t}), got shape {arr.shape}")
        for i, (d, n) in enumerate(zip(shape, arr.shape, strict=False)):
            if not sym.bind(d, n, self.env):
                raise InterpretError(f"{what}: dim {i} is {n} but the type says {d} ({self._env_text()})")
        if any(type(d) is str for d in shape):
            self.pending.append((t, arr.shape, what))

    def check_bound(self) -> None:
        """Dims written as expressions (``S+1``) are decided once all their symbols are bound."""
        for t, shape, what in self.pending:
            for i, (d, n) in enumerate(zip(t.shape, shape, strict=False)):
                try:
                    ok = sym.evaluate(d, self.env) == n
                except sym.DimError as e:
                    raise InterpretError(f"{what}: {e}") from None
                if not ok:
                    raise InterpretError(f"{what}: dim {i} is {n} but {d} = {sym.evaluate(d, self.env)}")
        self.pending.clear()

    def _env_text(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(self.env.items())) or "no symbols bound"

    def block(self, block: Block) -> list[np.ndarray]:
        for op in block:
            handler = _HANDLERS.get(op.name)
            if handler is None:
                if op.opdef.spec is None:
                    raise _failed(op, f"{op.name} has no reference implementation")
                outs = self.llm(op)
            else:
                outs = handler(self, op)
                if op.opdef.name in _TERMINATORS:
                    return outs
            for r, arr in zip(op.results, outs, strict=False):
                self.values[r] = arr
        return []

    def llm(self, op: Operation) -> list[np.ndarray]:
        spec = op.opdef.spec
        values = self.values
        arrays = [values[v] for v in op._operands]
        attrs = op.attributes
        if any(a.symbolic for a in attrs.values()):
            kw = {k: a.evaluate(self.env) for k, a in attrs.items()}
        else:
            kw = op.plain_attrs
        xp = self.xp
        try:
            out = self.kernels.get(op, spec.kernel)(xp, *arrays, **kw)
        except Exception as e:
            raise _failed(op, f"kernel failed: {type(e).__name__}: {e}") from e
        outs = [xp.asarray(o) for o in out] if spec.multi_output else [xp.asarray(out)]
        if len(outs) != len(op.results):
            raise _failed(op, f"kernel returned {len(outs)} arrays for {len(op.results)} results")
        for r, arr in zip(op.results, outs, strict=False):
            self.check(op, r.type, arr, r.index)
        return outs

    def check(self, op: Operation, t: Type, arr: np.ndarray, index: int) -> None:
        if arr.dtype != t.dtype:
            raise _failed(op, f"result #{index}: kernel gave dtype {arr.dtype}, the type says {t}")
        if isinstance(t, TensorType):
            if arr.ndim != len(t.shape):
                raise _failed(op, f"result #{index}: kernel gave shape {arr.shape}, the type says {t}")
            for d, n in zip(t.shape, arr.shape, strict=False):
                if not sym.bind(d, n, self.env) or (type(d) is str and sym.evaluate(d, self.env) != n):
                    msg = f"result #{index}: kernel gave shape {arr.shape}, the type says {t}"
                    raise _failed(op, f"{msg} ({self._env_text()})")


def _failed(op: Operation, msg: str) -> InterpretError:
    return InterpretError(f"{op.name}: {msg}\n    {format_op(op)}")


def _constant(run: _Run, op: Operation) -> list[np.ndarray]:
    value = op.attributes["value"].value
    return [value if run.xp is np else run.xp.asarray(value)]


def _parameter(run: _Run, op: Operation) -> list[np.ndarray]:
    name = op.attributes["name"].value
    if name not in run.params:
        raise _failed(op, f"no value for parameter {name!r}: pass params={{{name!r}: array}}")
    arr = np.asarray(run.params[name])
    run.bind(op.results[0].type, arr, f"parameter {name!r}")
    return [arr]


def _operands(run: _Run, op: Operation) -> list[np.ndarray]:
    return [run.values[v] for v in op._operands]


def _fusion(run: _Run, op: Operation) -> list[np.ndarray]:
    outs = run.block(op.regions[0].blocks[0])
    for r, arr in zip(op.results, outs, strict=False):
        run.check(op, r.type, arr, r.index)
    return outs


_HANDLERS: dict[str, Callable[[_Run, Operation], list[np.ndarray]]] = {
    "builtin.constant": _constant,
    "builtin.parameter": _parameter,
    "builtin.return": _operands,
    "cinn.yield": _operands,
    "cinn.fusion": _fusion,
}
_TERMINATORS = frozenset({"builtin.return", "cinn.yield"})


def run_ops(ops: Sequence[Operation], values: dict[Value, np.ndarray]) -> None:
    """Evaluate a few llm ops whose operands are in ``values`` (constant folding uses this)."""
    run = _Run({})
    run.values = values
    for op in ops:
        for r, arr in zip(op.results, run.llm(op), strict=False):
            values[r] = arr
