"""``to_static``: trace a function or Layer once per input signature, then run the program.

A call's *signature* is what the program depends on: for each tensor argument its dtype and rank
(and its static dims, where no ``InputSpec`` makes them symbolic), and the value of every other
argument (Python control flow on them is unrolled into the trace, so they are guards). A new trace
happens only when no cached signature matches. Tensors the code reaches besides its arguments
(parameters, buffers, optimizer state) are captured as extra inputs and read afresh at every call;
those it rebinds (``set_value``: optimizer updates) are outputs, written back after every run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backend as B
from ..ir import Program, Value, paused_gc
from ..tensor import Parameter, Tensor
from ..tracer import Trace, TraceError, tracing
from . import pytree


@dataclass(frozen=True)
class InputSpec:
    """The declared shape and dtype of a tensor argument; a dim given as a name or None is symbolic.

    ``InputSpec(["B", "S"], "int64")``: one program serves every batch size and sequence length.
    """

    shape: Sequence[int | str | None]
    dtype: Any = "float32"
    name: str | None = None

    def dims(self, arg_index: int) -> tuple:
        return tuple(
            f"_{self.name or 'a' + str(arg_index)}_{i}" if d is None else d for i, d in enumerate(self.shape)
        )


# Payloads of other worlds that change how a traced program runs (the distributed layer registers
# DistArray): ``kind.signature(payload)`` joins a call's cache key, and ``kind.prepare(program,
# payloads, compiler, params)`` annotates the traced program and returns what runs it
# (``.run(payloads)``); ``params`` are the positions of the payloads that are Parameters.
_PAYLOAD_KINDS: dict[type, Any] = {}


def register_payload_kind(payload_type: type, kind: Any) -> None:
    _PAYLOAD_KINDS[payload_type] = kind


@dataclass(eq=False)
class ConcreteProgram:
    """One traced signature: its program, the captured tensors, and how to run it (``runner``: what a
    payload kind prepared, else the program's executor, made on first use)."""

    program: Program
    n_args: int
    captures: list[Tensor]
    updated: list[Tensor]
    out_tree: Any
    n_outputs: int
    compiler: str | None
    runner: Any = None
    run_seed: Tensor | None = None

    @property
    def executor(self):
        if self.runner is None:
            from .compile import executor_for

            self.runner = executor_for(self.program, self.compiler)
        return self.runner

    def run(self, args: list[Tensor]) -> Any:
        if self.run_seed is not None:  # random ops draw anew at every run (tracer.run_seed)
            self.run_seed._data = B.to_device(np.asarray(B.random_seed(), np.int64), self.run_seed.device)
        inputs = [t._data for t in args] + [t._data for t in self.captures]
        outs = self.executor.run(inputs)
        for t, new in zip(self.updated, outs[self.n_outputs :]):
            t._data = new
        return pytree.unflatten(self.out_tree, [Tensor(o) for o in outs[: self.n_outputs]])


class StaticFunction:
    """What ``to_static`` returns: call it like the original; ``.program`` shows the traced PIR."""

    def __init__(
        self,
        fn: Callable[..., Any],
        input_spec: Sequence[InputSpec | None] | None = None,
        compiler: str | None = None,
        names: dict[int, str] | None = None,
    ) -> None:
        self.fn = fn
        self.input_spec = list(input_spec) if input_spec is not None else None
        self.compiler = compiler
        self._names = names
        self._cache: dict[Any, ConcreteProgram] = {}
        self.trace_count = 0
        self._last: ConcreteProgram | None = None

    # ---- signatures ----------------------------------------------------------------------------
    def _spec(self, i: int) -> InputSpec | None:
        """The InputSpec of argument ``i``, if any."""
        return self.input_spec[i] if self.input_spec is not None and i < len(self.input_spec) else None

    def _bind_args(self, args: tuple, kwargs: dict) -> tuple[list[Any], dict[str, Any]]:
        if not kwargs:
            return list(args), {}
        target = self.fn.forward if hasattr(self.fn, "forward") else self.fn
        try:
            bound = inspect.signature(target).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"to_static: {e}") from None
        return list(bound.args), dict(bound.kwargs)

    def _signature(self, args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, list[Tensor], list[tuple]]:
        key: list[Any] = []
        tensors: list[Tensor] = []
        dims: list[tuple] = []
        for i, a in enumerate(list(args) + [kwargs[k] for k in sorted(kwargs)]):
            if isinstance(a, np.ndarray):
                a = Tensor(a)
            if isinstance(a, Tensor):
                spec = self._spec(i)
                if spec is not None:
                    want = B.dtype(spec.dtype)
                    if (
                        len(spec.shape) != a.ndim
                        or a.dtype != want
                        or any(isinstance(d, int) and d != n for d, n in zip(spec.shape, a.shape))
                    ):
                        raise TypeError(
                            f"to_static: argument {i} does not match its InputSpec {list(spec.shape)} "
                            f"{B.dtype_name(want)}: got {list(a.shape)} {a.dtype}"
                        )
                    d = spec.dims(i)
                else:
                    d = tuple(a.shape)
                kind = _PAYLOAD_KINDS.get(type(a._data))
                key.append(("T", a.dtype.str, d) + (() if kind is None else (kind.signature(a._data),)))
                tensors.append(a)
                dims.append(d)
            else:
                try:
                    hash(a)
                except TypeError:
                    raise TypeError(
                        f"to_static: argument {i} ({type(a).__name__}) is neither a tensor nor hashable; "
                        "pass tensors, numpy arrays or plain Python values"
                    ) from None
                key.append(("V", type(a).__name__, a))
        key.append(tuple(sorted(kwargs)))
        return tuple(key), tensors, dims

    # ---- tracing -------------------------------------------------------------------------------
    def _trace(
        self, args: list[Any], kwargs: dict[str, Any], tensors: list[Tensor], dims: list[tuple]
    ) -> ConcreteProgram:
        program = Program()
        trace = Trace(program, "main", self._state_names())
        traced_args: list[Tensor] = []
        it = iter(zip(tensors, dims))

        def as_traced(a: Any, i: int) -> Any:
            if isinstance(a, (Tensor, np.ndarray)):
                t, d = next(it)
                spec = self._spec(i)
                name = (spec.name if spec is not None and spec.name else None) or f"arg{i}"
                v = trace.input(name, d, t.dtype)
                tt = Tensor(v, requires_grad=t.requires_grad)
                traced_args.append(tt)
                return tt
            return a

        all_args = [as_traced(a, i) for i, a in enumerate(args)]
        n = len(args)
        all_kwargs = {k: as_traced(kwargs[k], n + j) for j, k in enumerate(sorted(kwargs))}
        try:
            with tracing(trace), paused_gc():  # cyclic GC makes long traces superlinear
                out = self.fn(*all_args, **all_kwargs)
                leaves, tree = pytree.flatten(out)
                # outputs read before the captures are restored: a returned parameter is its input
                out_values = [
                    leaf._data if isinstance(leaf._data, Value) else trace.capture(leaf) for leaf in leaves
                ]
            updated = trace.finish()
        except BaseException:
            trace.abort()
            raise
        self._check_grads(trace)
        trace.builder.ret(*out_values, *[v for _, v in updated])
        program.verify()
        self.trace_count += 1
        payloads = [t._data for t in tensors] + [before for _, before, _ in trace.captures]
        kind = next((_PAYLOAD_KINDS[type(p)] for p in payloads if type(p) in _PAYLOAD_KINDS), None)
        inputs = [*tensors, *(t for t, _, _ in trace.captures)]
        params = [i for i, t in enumerate(inputs) if isinstance(t, Parameter)]
        return ConcreteProgram(
            program,
            len(traced_args),
            [t for t, _, _ in trace.captures],
            [t for t, _ in updated],
            tree,
            len(out_values),
            self.compiler,
            None if kind is None else kind.prepare(program, payloads, self.compiler, params),
            trace.run_seed,
        )

    def _check_grads(self, trace: Trace) -> None:
        for t, _, _ in trace.captures:
            if t.grad is not None and isinstance(t.grad._data, Value):
                name = trace.names.get(id(t)) or t.name or "a captured tensor"
                t.grad = None
                raise TraceError(
                    f"to_static: the gradient of {name} escapes the traced function; call optimizer.step() "
                    "and optimizer.zero_grad() inside it, or return the gradients (lf.grad)"
                )

    def _state_names(self) -> dict[int, str]:
        names = dict(self._names or {})
        layer = self.fn if hasattr(self.fn, "named_parameters") else getattr(self.fn, "__self__", None)
        if layer is not None and hasattr(layer, "named_parameters"):
            for k, t in [*layer.named_parameters(), *layer.named_buffers()]:
                names.setdefault(id(t), k)
        return names

    # ---- calling -------------------------------------------------------------------------------
    def _lookup(self, args: tuple, kwargs: dict) -> tuple[ConcreteProgram, list[Tensor]]:
        """The program for this call's signature (traced now if new) and its tensor arguments."""
        args_l, kwargs_d = self._bind_args(args, kwargs)
        key, tensors, dims = self._signature(args_l, kwargs_d)
        cp = self._cache.get(key)
        if cp is None:
            cp = self._cache[key] = self._trace(args_l, kwargs_d, tensors, dims)
        self._last = cp
        return cp, tensors

    def get_concrete_program(self, *args: Any, **kwargs: Any) -> ConcreteProgram:
        return self._lookup(args, kwargs)[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cp, tensors = self._lookup(args, kwargs)
        return cp.run(tensors)

    @property
    def program(self) -> Program:
        """The most recently used traced program."""
        if self._last is None:
            raise RuntimeError(
                "to_static: nothing traced yet; call the function once (or get_concrete_program)"
            )
        return self._last.program

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"<StaticFunction {name}: {self.trace_count} traces>"


def to_static(
    fn: Callable[..., Any] | None = None,
    input_spec: Sequence[InputSpec | None] | None = None,
    compiler: str | None = None,
    names: dict[int, str] | None = None,
) -> Any:
    """Trace ``fn`` (a function or a Layer) into a static program run by the executor.

    Usable as ``to_static(fn, ...)`` or as a decorator ``@to_static(input_spec=...)``.
    ``compiler``: "cinn" fuses and compiles, "none" runs the traced ops; None (the default) means
    "cinn" wherever a C compiler exists.
    """
    if fn is None:
        return lambda f: StaticFunction(f, input_spec, compiler, names)
    return StaticFunction(fn, input_spec, compiler, names)
