"""The executor: runs a PIR function fast, the way every static job runs.

Compiling a function makes a flat plan once: each op's kernel resolved from the op table, operand
and result slots, attributes already plain (those holding symbolic dims are evaluated per call
with the sizes bound from the inputs), and the slots to free after each step (liveness), so
intermediates die at their last use. ``cinn.fusion`` ops run as the compiled kernel the compiler
attached to them, or op by op from their region (``ir.run_group``). ``LLMKIT_PROFILE=1`` collects
time per op type and prints the table at exit; ``with dispatch.profiling() as table`` collects it
(eager ops too) for a while (``benchmarks/train_throughput.py --profile``).

``native=True`` (every compiled program) runs ops that have a hand-written C kernel with it, and
replays the whole function in one C call whenever every step is a C kernel or a view: no Python
between ops. Both come from the compiler, which registers them (``compiler/native/run.py``) as it
registers the kernels of ``cinn.fusion``: the executor imports nothing above the IR.

Freed arrays go back to glibc; large ones would be returned to the OS and page-faulted in again at
the next step (about 8 ms per 32 MiB here), so the executor raises glibc's mmap and trim
thresholds once (``memory.keep_freed_memory``): freed blocks stay in the heap for the next step.
"""

from __future__ import annotations

import atexit
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import backend as B
from . import dispatch as D
from . import symbolic as sym
from .ir import FuncOp, Operation, Program, Value
from .ir.interpreter import run_group
from .ir.printer import format_op
from .memory import keep_freed_memory


class ExecutionError(RuntimeError):
    """A program that cannot run on the given inputs; the message names the op or the input."""


class FallbackWarning(RuntimeWarning):
    """Compiled work runs the reference kernels instead (no C compiler, a kernel that failed to
    compile or to load, a group the compiler could not lower), or its kernels run on one thread
    (the thread pool failed to build), or a step of a GPU program computed on the host (its kernel
    returned a numpy array): still correct, much slower. The test suite turns it into an error
    (pyproject.toml), so a compiled or GPU path cannot pass on fallbacks."""


_host_steps: set[str] = set()  # steps of GPU programs already reported as computed on the host


def _device_array(xp: Any, out: Any, step: str) -> Any:
    """A step's output as an array of the program's module; on the GPU a host array means the
    kernel ran on the host (said once per step name) and is moved to the device."""
    if xp is not np and type(out) is np.ndarray and step not in _host_steps:
        import warnings

        _host_steps.add(step)
        warnings.warn(
            f"{step}: its kernel returned a host (numpy) array in a GPU program; the step ran on the "
            "host and its result is copied to the device",
            FallbackWarning,
            stacklevel=3,
        )
    return xp.asarray(out)


# Op name -> function(op) returning a callable(xp, *arrays) -> array | tuple. The compiler
# registers "cinn.fusion" here; unknown non-llm ops are an error at compile time.
LOWERINGS: dict[str, Callable[[Operation], Callable[..., Any] | None]] = {}

# What native executors run (``register_native``, by the compiler): an op's hand-written kernel,
# called like its reference kernel (or None), and the replays of an executor's whole function.
_native_kernel: Callable[[Operation], Callable[..., Any] | None] | None = None
_replays: Callable[[Executor], Any] | None = None


def register_native(kernel: Callable[[Operation], Any], replays: Callable[[Executor], Any]) -> None:
    """How executors planned with ``native=True`` run ops with a hand-written C kernel
    (``kernel(op)``: a callable like the op's reference kernel, or None) and replay whole functions
    (``replays(executor).run(env, inputs)``: the outputs, or None to run op by op)."""
    global _native_kernel, _replays
    _native_kernel, _replays = kernel, replays


_PROFILE = os.environ.get("LLMKIT_PROFILE", "") not in ("", "0")
_profile: dict[str, list[float]] = D.new_profile()


def _report() -> None:
    if not _profile:
        return
    total = sum(t for t, _, _ in _profile.values()) or 1.0
    print("\nLLMKIT_PROFILE: time per op type (executor)")
    print(f"{'op':<40}{'calls':>10}{'total ms':>12}{'%':>7}")
    for name, (t, n, _) in sorted(_profile.items(), key=lambda kv: -kv[1][0]):
        print(f"{name:<40}{n:>10}{t * 1e3:>12.2f}{100 * t / total:>7.1f}")


if _PROFILE:
    D.profile_table = _profile  # every op of the process, reported at exit
    atexit.register(_report)


def _as_eager(spec: Any) -> Callable[..., Any]:
    """An op's kernel as eager runs it (``dispatch.EagerWorld``: its C kernel where one applies), so a
    program with the reference kernels (``compiler="none"``) computes what eager does, bit for bit."""

    def kernel(xp: Any, *arrays: Any, **attrs: Any) -> Any:
        fn = D._native(spec, arrays, attrs) if D._native is not None and xp is np else None
        return (fn or spec.kernel)(xp, *arrays, **attrs)

    return kernel


class _Step:
    __slots__ = ("attrs", "fn", "free", "ins", "kind", "multi", "name", "outs", "sym_attrs")

    def __init__(self, name, fn, ins, outs, attrs, sym_attrs, multi, kind):
        self.name, self.fn, self.ins, self.outs = name, fn, ins, outs
        self.attrs, self.sym_attrs, self.multi, self.kind = attrs, sym_attrs, multi, kind
        self.free: tuple[int, ...] = ()


class Executor:
    """A compiled plan of one function of a program: ``executor.run(inputs) -> outputs``.

    ``native=True``: ops with a C kernel (``OpSpec.native``) run it, and calls whose every step is
    a C kernel or a view are replayed in one C call (``compiler/native/run.py``); without a C compiler
    (or without the compiler loaded) it is the same as False.
    """

    def __init__(self, program: Program | FuncOp, func: str | None = None, *, native: bool = False) -> None:
        keep_freed_memory()
        self.native = native
        f = program.function(func) if isinstance(program, Program) else program
        self.name = f.name
        self.arg_types = [a.type for a in f.args]
        self.arg_names = [a.name for a in f.args]
        self._slot: dict[Value, int] = {}
        self._types: list[Any] = []  # each slot's value type (its bytes, for peak_bytes)
        self.consts: list[tuple[int, np.ndarray]] = []
        self.steps: list[_Step] = []
        self.input_slots = [self._new(a) for a in f.args]
        self.output_slots: list[int] = []
        self._device_consts: dict[str, list[tuple[int, Any]]] = {}
        self._plan_block(f.body)
        self.symbolic = any(isinstance(d, str) for t in self.arg_types for d in t.shape)
        # per argument: its type, and its shape when fully static (a tuple compare, no binding)
        self._arg_checks = [
            (t, None if any(isinstance(d, str) for d in t.shape) else tuple(t.shape)) for t in self.arg_types
        ]
        self._liveness()
        self._replays = _replays(self) if native and _replays is not None else None
        # bind's memo (replayed executors): the binding of each checked shape of the symbolic
        # arguments, and the inputs of the last replay (which holds them anyway)
        self._sym_args = [i for i, (_, static) in enumerate(self._arg_checks) if static is None]
        self._seen: list[Any] = [None] * len(self.arg_types)
        self._envs: dict[tuple, dict[str, int]] = {}

    # ---- planning ------------------------------------------------------------------------------
    def _new(self, v: Value) -> int:
        i = len(self._slot)
        self._slot[v] = i
        self._types.append(v.type)
        return i

    def _plan_block(self, block) -> list[int]:
        for op in block:
            name = op.name
            if name == "builtin.return" or name == "cinn.yield":
                outs = [self._slot[v] for v in op.operands]
                if name == "builtin.return":
                    self.output_slots = outs
                return outs
            if name == "builtin.constant":
                self.consts.append((self._new(op.results[0]), np.asarray(op.attributes["value"].value)))
                continue
            lower = LOWERINGS.get(name)
            fn = lower(op) if lower is not None else None
            if fn is None and name == "cinn.fusion":
                fn = self._unfused(op)
            spec = op.opdef.spec
            if fn is None and self.native and _native_kernel is not None and spec is not None:
                fn = _native_kernel(op)
            if fn is None:
                if spec is None:
                    raise ExecutionError(f"{name}: no kernel for this op\n    {format_op(op)}")
                eager_native = not self.native and spec.native is not None and spec.native.eager
                fn = _as_eager(spec) if eager_native else spec.kernel
            ins = tuple(self._slot[v] for v in op.operands)
            outs = tuple(self._new(r) for r in op.results)
            sym_attrs = {k: a for k, a in op.attributes.items() if a.symbolic}
            attrs = {k: a.value for k, a in op.attributes.items() if not a.symbolic}
            multi = spec.multi_output if spec is not None else len(outs) != 1
            label = getattr(fn, "profile_name", name)  # compiled groups: "cinn.fusion[rms_norm]"
            kind = spec.kind if spec is not None else None
            self.steps.append(_Step(label, fn, ins, outs, attrs, sym_attrs, multi, kind))
        return []

    def _unfused(self, fusion: Operation) -> Callable[..., Any]:
        """A group without a compiled kernel: its ops one by one (``ir.run_group``), each with its
        hand-written C kernel where this executor runs those."""
        kernels = {}
        if self.native and _native_kernel is not None:
            body = fusion.regions[0].blocks[0]
            kernels = {
                o: k for o in body if o.opdef.spec is not None and (k := _native_kernel(o)) is not None
            }

        def run(xp: Any, *arrays: Any, **attrs: Any) -> Any:
            return run_group(fusion, xp, arrays, kernels)

        label = fusion.attributes["name"].value if "name" in fusion.attributes else "?"
        run.profile_name = f"cinn.fusion[{label}] unfused"  # type: ignore[attr-defined]
        return run

    def _liveness(self) -> None:
        """Free each intermediate after the last step that reads it."""
        keep = set(self.output_slots)
        last: dict[int, int] = {}
        for i, st in enumerate(self.steps):
            for s in st.ins:
                last[s] = i
            for s in st.outs:
                last.setdefault(s, i)  # results nobody reads die right away
        frees: dict[int, list[int]] = defaultdict(list)
        for s, i in last.items():
            if s not in keep:
                frees[i].append(s)
        for i, st in enumerate(self.steps):
            st.free = tuple(frees.get(i, ()))
        self.num_slots = len(self._slot)

    def peak_bytes(self, env: dict[str, int] | None = None) -> int:
        """The most bytes of intermediates alive at once under this plan's liveness: the program's
        activation memory. Inputs, constants and outputs are excluded (a train step's outputs are
        the updated state, counted with it); symbolic dims are bound by ``env`` (as :meth:`bind`
        returns it). A view counts as a buffer of its own, so this is an upper bound."""
        env = env or {}

        def size(s: int) -> int:
            t = self._types[s]
            if not hasattr(t, "shape"):  # not a tensor (a token, a tuple)
                return 0
            return B.dtype(t.dtype).itemsize * int(np.prod([sym.evaluate(d, env) for d in t.shape]))

        made = {s for st in self.steps for s in st.outs} - set(self.output_slots)
        live = peak = 0
        for st in self.steps:
            live += sum(size(s) for s in st.outs if s in made)
            peak = max(peak, live)
            live -= sum(size(s) for s in st.free if s in made)
        return peak

    # ---- running -------------------------------------------------------------------------------
    def bind(self, inputs: Sequence[Any]) -> dict[str, int]:
        """Check inputs against the argument types and bind their symbolic dims."""
        if len(inputs) != len(self.arg_types):
            raise ExecutionError(f"@{self.name} takes {len(self.arg_types)} inputs, got {len(inputs)}")
        key = tuple([inputs[i].shape for i in self._sym_args])
        env = self._envs.get(key)
        if env is not None:  # these shapes bound before: check only the inputs not replayed last time
            checks, seen = self._arg_checks, self._seen
            if all(
                x.dtype == checks[i][0].dtype and checks[i][1] in (None, x.shape)
                for i, x in enumerate(inputs)
                if x is not seen[i]
            ):
                return dict(env)
        env = {}
        for i, ((t, static), x) in enumerate(zip(self._arg_checks, inputs)):
            if x.dtype != t.dtype or (x.shape != static if static is not None else not self._bind(t, x, env)):
                self._bad_input(i, x, env)
        if self._replays is not None:
            self._envs = self._envs if len(self._envs) < 64 else {}
            self._envs[key] = dict(env)
        return env

    @staticmethod
    def _bind(t: Any, x: Any, env: dict[str, int]) -> bool:
        shape = t.shape
        if len(x.shape) != len(shape):
            return False
        return all(sym.bind(d, n, env) for d, n in zip(shape, x.shape))

    def _bad_input(self, i: int, x: Any, env: dict[str, int]) -> None:
        t, name = self.arg_types[i], self.arg_names[i]
        bound = ", ".join(f"{k}={v}" for k, v in sorted(env.items()))
        raise ExecutionError(
            f"@{self.name}: input %{name} must be {t}, got shape {list(x.shape)} {x.dtype}"
            + (f" ({bound})" if bound else "")
        )

    def run(self, inputs: Sequence[Any]) -> list[Any]:
        """Run the plan on arrays (numpy or cupy); return the function's outputs."""
        env = self.bind(inputs)
        if self._replays is not None and D.profile_table is None:
            outs = self._replays.run(env, inputs)
            if outs is not None:
                self._seen = list(inputs)
                return outs
        xp = np
        for x in inputs:
            if type(x) is not np.ndarray:
                xp = B.xp_of(x)
                break
        if xp is not np:  # a program on the GPU: host arrays passed in (token batches) move there
            inputs = [xp.asarray(x) if type(x) is np.ndarray else x for x in inputs]
        slots: list[Any] = [None] * self.num_slots
        for s, x in zip(self.input_slots, inputs):
            slots[s] = x
        for s, c in self._consts(xp):
            slots[s] = c
        profile = D.profile_table
        host = xp is np
        for st in self.steps:
            attrs = st.attrs
            if st.sym_attrs:
                attrs = {**attrs, **{k: a.evaluate(env) for k, a in st.sym_attrs.items()}}
            args = [slots[i] for i in st.ins]
            if profile is not None:
                t0 = time.perf_counter()
            try:
                out = st.fn(xp, *args, **attrs)
            except Exception as e:
                shapes = ", ".join(f"{list(a.shape)} {a.dtype}" for a in args)
                raise ExecutionError(f"{st.name} failed on ({shapes}): {type(e).__name__}: {e}") from e
            if profile is not None:
                D.record(profile, st.name, time.perf_counter() - t0, st.kind, args, attrs, out)
            if st.multi:
                for s, o in zip(st.outs, out):
                    slots[s] = o if host and type(o) is np.ndarray else _device_array(xp, o, st.name)
            else:
                slots[st.outs[0]] = (
                    out if host and type(out) is np.ndarray else _device_array(xp, out, st.name)
                )
            for s in st.free:
                slots[s] = None
        return [slots[s] for s in self.output_slots]

    def _consts(self, xp) -> list[tuple[int, Any]]:
        if xp is np:
            return self.consts
        key = xp.__name__
        if key not in self._device_consts:
            self._device_consts[key] = [(s, xp.asarray(c)) for s, c in self.consts]
        return self._device_consts[key]
