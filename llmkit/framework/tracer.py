"""Tracing: Python code runs once with tracer values, and every op it applies becomes PIR.

``Trace`` is one tracing session: a function being built, with a ``Builder`` at its end. The
``TracerWorld`` (registered with dispatch for PIR values) turns each ``apply`` into
``builder.create``, with result types from the op's ``infer_meta``, so symbolic dims flow
through. Concrete tensors reached from the traced code (parameters, buffers, optimizer state,
constants built eagerly) are *captured*: each becomes a named function input, and the tensor's
payload is swapped for that input while tracing, so ``set_value`` on it (an optimizer update)
rebinds it to the new traced value, which then becomes a program output written back after each
run. Nothing is computed while tracing.
"""

from __future__ import annotations

import os
import threading
import traceback
from typing import Any

import numpy as np

from . import backend as B
from .dispatch import World, ambient, register_world
from .ir import Builder, Program, TensorType, Value
from .ir.core import BlockArgument, OpResult
from .opspec import OpSpec
from .tensor import Tensor

_FRAMEWORK_DIR = os.path.dirname(os.path.abspath(__file__))
_local = threading.local()


class TraceError(TypeError):
    """Code that cannot be traced into a static program; the message names the user's line."""


def user_frame() -> str:
    """``file:line`` of the innermost caller outside llmkit.framework (the user's code)."""
    for frame in reversed(traceback.extract_stack()):
        f = os.path.abspath(frame.filename)
        if not f.startswith(_FRAMEWORK_DIR) and "contextlib" not in f:
            return f"{frame.filename}:{frame.lineno}"
    return "<unknown>"


class Trace:
    """One function being traced into ``program``."""

    def __init__(
        self, program: Program, name: str, names: dict[int, str] | None = None, builder: Builder | None = None
    ) -> None:
        self.program = program
        self.func = program.function(name) if builder is not None else program.add_function(name)
        self.builder = builder or Builder.at_end(self.func.body)
        self.names = names or {}  # id(tensor) -> a readable name for captured state
        self.captures: list[tuple[Tensor, Any, Value]] = []  # (tensor, payload before, input value)
        self._captured: set[int] = set()
        self._used_names: set[str] = set()
        self.run_seed: Tensor | None = None  # random ops' per-run input (TracerWorld.run_seed)
        self.random_ops = 0

    def _unique(self, name: str) -> str:
        base, i = name, 1
        while name in self._used_names:
            name = f"{base}_{i}"
            i += 1
        self._used_names.add(name)
        return name

    def input(self, name: str, shape: tuple, dtype: Any) -> Value:
        """A new function input (a block argument)."""
        return self.func.body.add_argument(TensorType(shape, dtype), self._unique(_sanitize(name)))

    def capture(self, t: Tensor) -> Value:
        """Make concrete tensor ``t`` a function input and swap its payload for it while tracing."""
        if id(t) in self._captured and isinstance(t._data, Value):
            return t._data
        if isinstance(t._data, Value):  # (a distributed tensor is captured like a concrete one)
            raise TraceError(f"cannot capture {t!r}: it is neither concrete nor a value of this trace")
        name = self.names.get(id(t)) or t.name or f"capture{len(self.captures)}"
        v = self.input(name, tuple(t.shape), t.dtype)
        self.captures.append((t, t._data, v))
        self._captured.add(id(t))
        t._data = v
        return v

    def finish(self) -> list[tuple[Tensor, Value]]:
        """Restore every captured tensor; return those rebound during tracing with their new value."""
        updated = []
        for t, before, v in self.captures:
            if t._data is not v:
                if not isinstance(t._data, Value):
                    raise TraceError(
                        f"captured tensor {self.names.get(id(t)) or t.name or ''} was given a concrete value "
                        "while tracing; set it outside the traced function"
                    )
                updated.append((t, t._data))
            t._data = before
        return updated

    def abort(self) -> None:
        for t, before, _ in self.captures:
            t._data = before


def current_trace() -> Trace:
    stack = getattr(_local, "stack", None)
    if not stack:
        raise TraceError("no trace is active")
    return stack[-1]


class TracerWorld(World):
    """Records ops into the active trace instead of running them."""

    name = "tracing"
    captures = True  # concrete and distributed tensors among an op's inputs become program inputs

    def run(self, spec: OpSpec, payloads: list[Any], attrs: dict[str, Any], inputs: tuple = ()) -> Any:
        trace = current_trace()
        operands = []
        for p, x in zip(payloads, inputs):
            if isinstance(p, Value):
                operands.append(p)
            elif isinstance(x, Tensor):
                operands.append(trace.capture(x))
            else:
                operands.append(self.constant(p, B.dtype(p.dtype)))
        op = trace.builder.create(spec, operands, attrs)
        return tuple(op.results) if spec.multi_output else op.results[0]

    def constant(self, value: Any, dtype: np.dtype, like: Any = None) -> Any:
        return current_trace().builder.constant(np.asarray(value, dtype=dtype))

    def run_seed(self) -> tuple[Tensor, int]:
        """The trace's ``run_seed``, captured as a program input that ``ConcreteProgram.run`` sets to a
        fresh draw of the generator before every run, and the op's index: a traced dropout draws a
        new mask at each call, as eager code does (a seed drawn at tracing repeated one mask at every
        step), and tracing draws nothing (a run resumed from a checkpoint draws what it would have)."""
        trace = current_trace()
        if trace.run_seed is None:
            trace.run_seed = Tensor(B.to_device(np.zeros((), np.int64), B.get_device()))
            trace.names[id(trace.run_seed)] = "run_seed"
        trace.random_ops += 1
        return trace.run_seed, trace.random_ops - 1

    def concrete_error(self, what: str, tensor: Any) -> Exception:
        return TraceError(
            f"{what} at {user_frame()} needs the tensor's value, which does not exist while tracing into a "
            "static program: the program must work for every input. Branch on Python values (shapes, "
            "config) instead, or compute both sides and pick with ops.where(condition, a, b); "
            "read values after the static function returns."
        )


TRACER = TracerWorld()
register_world(OpResult, TRACER)
register_world(BlockArgument, TRACER)


class tracing:
    """Context manager: ops inside are recorded into ``trace`` (ops without tensor inputs too)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._ambient = ambient(TRACER)

    def __enter__(self) -> Trace:
        _local.__dict__.setdefault("stack", []).append(self.trace)
        self._ambient.__enter__()
        return self.trace

    def __exit__(self, *exc: Any) -> None:
        self._ambient.__exit__(*exc)
        _local.stack.pop()


def _sanitize(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return out if out and not out[0].isdigit() else f"v{out}"
