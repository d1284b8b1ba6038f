"""``apply(op, *inputs, **attrs)``: the one path from an op call to its computation.

The inputs decide the *world* the op runs in:

- plain arrays (the default): the eager world runs the op's reference kernel;
- tracer values (inside ``to_static``): the tracing world appends an operation to a PIR block;
- distributed values (auto-parallel): that world applies the op's SPMD rule, reshards, runs locally.

This module imports neither the tracer nor the distributed layer: each registers its payload type
with :func:`register_world` (so imports keep pointing down). Whatever the world, ``apply`` wraps
the results in Tensors and records the autograd node (``tape.py``), so eager autograd and program
autodiff are the same code.

``public(spec)`` is an op's Python function (positional arguments fill its tensor inputs, then
its attributes): ``lf.ops.<name>``, the Tensor methods, and ``O.<name>``, with which op rules
(vjp, decompose) and the autograd call other ops, resolved when called.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from . import backend as B
from .opspec import REQUIRED, OpError, OpSpec, describe, get, table
from .tape import Node, grad_mode
from .tensor import Tensor, register_value_error


class World:
    """How ops run on one kind of payload."""

    name = "world"
    captures = False  # takes tensors of other worlds as inputs (the tracer captures them)

    def run(self, spec: OpSpec, payloads: list[Any], attrs: dict[str, Any], inputs: tuple = ()) -> Any:
        """Compute (or record) the op; return one payload, or a tuple for multi-output ops.

        ``inputs`` are the caller's arguments (Tensors, scalars) behind ``payloads``, for worlds
        that need a tensor's identity (the tracer captures outside tensors as program inputs).
        """
        raise NotImplementedError

    def constant(self, value: Any, dtype: np.dtype, like: Any = None) -> Any:
        """Lift a Python scalar or an array into this world's payload (``like``: a payload of the
        op's tensor inputs, whose device an eager constant goes to)."""
        raise NotImplementedError

    def concrete_error(self, what: str, tensor: Any) -> Exception:
        """The error for reading a value (``.numpy()``, ``if t:``) of a tensor of this world."""
        return TypeError(f"{what} needs a tensor with concrete values, not a {self.name} tensor")

    def run_seed(self) -> tuple[Tensor, int] | None:
        """For a random op (``dropout``): an int64 scalar that this world's programs read as an input
        set afresh at every run, and the op's index among the program's random ops; None where ops
        run at once and draw their seeds at the call."""
        return None


# ------------------------------------------------------------------------------ profiling

profile_table: dict[str, list[float]] | None = None  # where op calls are timed now (None: nowhere)


def new_profile() -> dict[str, list[float]]:
    return defaultdict(lambda: [0.0, 0, 0.0])  # op label -> [seconds, calls, FLOPs]


@contextlib.contextmanager
def profiling():
    """Time every eager op's kernel and every executor step run inside into a fresh table, op label
    -> [seconds, calls, FLOPs of contractions]; compiled functions run op by op meanwhile (no replays)."""
    global profile_table
    prev, profile_table = profile_table, new_profile()
    try:
        yield profile_table
    finally:
        profile_table = prev


def record(table: dict[str, list[float]], name: str, seconds: float, kind: Any, args, attrs, out) -> None:
    """Add one op call to a profile table (a contraction's FLOPs: 2 x output size x the summed dim)."""
    rec = table[name]
    rec[0] += seconds
    rec[1] += 1
    if kind == "contraction" and hasattr(out, "size"):
        rec[2] += 2.0 * out.size * args[0].shape[-2 if attrs.get("transpose_x") else -1]


_native: Callable[[OpSpec, list, dict], Callable[..., Any] | None] | None = None


def register_eager_native(kernel: Callable[[OpSpec, list, dict], Callable[..., Any] | None]) -> None:
    """How eager ops whose spec has a C kernel run it (``kernel(spec, arrays, attrs)``: a callable
    like the reference kernel, or None); the compiler registers it (``compiler/native/run.py``)."""
    global _native
    _native = kernel
    for spec in table().values():  # host calls choose their kernel afresh
        spec.eager.clear()


_fast_apply: Callable[[OpSpec, tuple, dict], Any] | None = None


def register_eager_fast(fast: Callable[[OpSpec, tuple, dict], Any], wrap: Callable[[Any], Tensor]) -> None:
    """``_apply``'s common case in C (``compiler/native/pyext.py``): ``fast(spec, inputs, attrs)``
    gives the result Tensor of a call ``run_arrays`` has cached, or None (the Python path);
    ``wrap``: ``Tensor._wrap`` in C. (Registered before any op runs: no cached entry to clear.)"""
    global _fast_apply, _wrap
    _fast_apply, _wrap = fast, wrap
    Tensor._wrap = wrap  # type: ignore[method-assign]


class EagerWorld(World):
    """Runs the op's kernel on numpy/cupy arrays right away: its C kernel (``OpSpec.native``) on
    host arrays where one applies and the compiler is loaded, as compiled programs do, else the
    reference kernel."""

    name = "eager"

    def run(self, spec: OpSpec, arrays: list[Any], attrs: dict[str, Any], inputs: tuple = ()) -> Any:
        xp = np if arrays else B.xp_for(B.get_device())  # no inputs (arange): the current device
        for a in arrays:
            if a is not None and type(a) is not np.ndarray:
                xp = B.xp_of(a)
                break
        if xp is not np:  # an op on the GPU: host arrays among its inputs move there
            arrays = [xp.asarray(a) if type(a) is np.ndarray else a for a in arrays]
        return run_arrays(spec, xp, arrays, attrs)[0]

    def constant(self, value: Any, dtype: np.dtype, like: Any = None) -> Any:
        xp = B.xp_of(like) if like is not None else B.xp_for(B.get_device())
        return xp.asarray(value, dtype=dtype)


def run_arrays(spec: OpSpec, xp: Any, arrays: list[Any], attrs: dict[str, Any]) -> tuple[Any, dict]:
    """An eager op on arrays of ``xp``, and its bound attributes. One dict lookup per combination of
    input shapes, dtypes and attributes as given finds them bound, validated by ``infer_meta`` (one
    clear error naming the op and the shapes; it reads nothing else) and the kernel: the C kernel
    where one applies (it runs the reference kernel off the host), else the reference kernel."""
    n = len(arrays)
    if n == 2:
        a, b = arrays
        key: Any = (a.shape, a.dtype, b.shape, b.dtype)
    elif n == 1:
        a = arrays[0]
        key = (a.shape, a.dtype)
    else:
        key = tuple([(a.shape, a.dtype) for a in arrays])
    if attrs:  # (with the values' types: True == 1, but an int attribute refuses True)
        key = (key, *attrs.items(), *map(type, attrs.values()))
    try:
        entry = spec.eager.get(key)
    except TypeError:  # an unhashable attribute: bound and validated at every call
        entry = key = None
    if entry is None:
        bound = spec.bind(attrs) if attrs or spec.attrs else attrs
        spec.infer_meta(*arrays, **bound)
        native = _native(spec, arrays, bound) if spec.native is not None and _native is not None else None
        entry = (bound, native or spec.kernel)
        if key is not None:
            if len(spec.eager) >= _VALIDATED_MAX:
                spec.eager.clear()
            spec.eager[key] = entry
    attrs, kernel = entry
    table = profile_table
    t0 = time.perf_counter() if table is not None else 0.0
    try:
        out = kernel(xp, *arrays, **attrs)
    except OpError:
        raise
    except Exception as e:
        shown = ", ".join(describe(a) for a in arrays)
        raise OpError(f"{spec.name}: kernel failed on ({shown}): {e}") from e
    if table is not None:
        record(table, f"llm.{spec.name}", time.perf_counter() - t0, spec.kind, arrays, attrs, out)
    if type(out) is np.ndarray:
        return out, attrs
    # numpy reductions and 0-d arithmetic return numpy scalars; payloads are always arrays.
    if spec.multi_output:
        return tuple(o if type(o) is np.ndarray else xp.asarray(o) for o in out), attrs
    return xp.asarray(out), attrs


_VALIDATED_MAX = 4096  # signatures remembered per op (inference sees many sequence lengths)


EAGER = EagerWorld()
_BOOL = np.dtype(np.bool_)
_WORLDS: dict[type, World] = {}


class _Ambient(threading.local):
    def __init__(self) -> None:
        self.stack: list[World] = []  # this thread's ambient worlds, innermost last


_local = _Ambient()


def register_world(payload_type: type, world: World) -> None:
    """Route ops whose inputs carry ``payload_type`` payloads to ``world``."""
    _WORLDS[payload_type] = world


def world_of(payload: Any) -> World:
    return _WORLDS.get(type(payload), EAGER)


# Reading the values of a tensor that has none (``.numpy()`` of a tracer) raises its world's error.
register_value_error(lambda what, t: world_of(t._data).concrete_error(what, t))


@contextlib.contextmanager
def ambient(world: World):
    """Ops with no world-specific inputs (constants, creation ops) run in ``world`` inside."""
    stack = _local.stack
    stack.append(world)
    try:
        yield world
    finally:
        stack.pop()


def current_world() -> World:
    stack = _local.stack
    return stack[-1] if stack else EAGER


def _scalar_dtype(spec: OpSpec, value: Any, ref: Any) -> np.dtype:
    """The dtype a Python scalar takes: the dtype of the op's first non-bool tensor input."""
    if type(value) is float and ref in B.FLOAT_DTYPES:
        return ref
    if isinstance(value, (bool, np.bool_)):
        return B.DTYPES["bool"]
    if ref is None:
        return B.DTYPES["int64"] if isinstance(value, (int, np.integer)) else B.get_default_dtype()
    if isinstance(value, (float, np.floating)) and not B.is_floating(ref) and not float(value).is_integer():
        raise OpError(
            f"{spec.name}: cannot combine a {B.dtype_name(ref)} tensor with the float {value!r}; cast first"
        )
    return ref


def apply(op: OpSpec | str, *inputs: Any, **attrs: Any) -> Any:
    """Apply an op to tensors (or Python scalars / arrays, lifted to constants) and return Tensors."""
    return _apply(op if type(op) is OpSpec else get(op), inputs, attrs)  # type: ignore[arg-type]


def _apply(spec: OpSpec, inputs: tuple, attrs: dict[str, Any]) -> Any:
    """``apply`` with the inputs and attributes as given (not bound yet)."""
    if _fast_apply is not None and (out := _fast_apply(spec, inputs, attrs)) is not None:
        return out
    n = len(inputs)
    while n > spec.min_inputs and inputs[n - 1] is None:  # omitted trailing optional inputs
        n -= 1
    if n != len(inputs):
        inputs = inputs[:n]
    if n < spec.min_inputs or (spec.max_inputs is not None and n > spec.max_inputs):
        spec.check_arity(n)
    # The common case first: every input a Tensor on numpy or a Python number, outside any trace.
    payloads: list[Any] = []
    grad = lifted = False
    for x in inputs:
        if isinstance(x, Tensor):
            d = x._data
            if type(d) is not np.ndarray:
                break
            if x.requires_grad:
                grad = True
        elif type(x) is float or type(x) is int:  # (not bool: its type is not int)
            lifted = True
            d = x
        else:
            break
        payloads.append(d)
    else:
        if not _local.stack and (not lifted or B.get_device() == "cpu"):
            if lifted:  # numbers become host constants, as EagerWorld.constant makes them here
                ref = next((p.dtype for p in payloads if type(p) is np.ndarray and p.dtype != _BOOL), None)
                payloads = [
                    p if type(p) is np.ndarray else np.asarray(p, dtype=_scalar_dtype(spec, p, ref))
                    for p in payloads
                ]
            out, attrs = run_arrays(spec, np, payloads, attrs)
            if grad or spec.multi_output:
                return _record(spec, inputs, out, attrs, payloads if lifted else None)
            return _wrap(out)  # no input requires grad: nothing to record
    if attrs or spec.attrs:
        attrs = spec.bind(attrs)
    return _apply_general(spec, inputs, attrs)


def host_array(x: Tensor) -> np.ndarray | None:
    """x's host array where a view of it needs no op record: no gradient to track, outside any
    trace or profile (None otherwise); views (``.T``, ``x[1]``) then are numpy's own, and the op
    runs only for an error or a gradient."""
    d = x._data
    ok = type(d) is np.ndarray and not (x.requires_grad and grad_mode.enabled) and profile_table is None
    return d if ok and not _local.stack else None


def _apply_general(spec: OpSpec, inputs: tuple, attrs: dict[str, Any]) -> Any:
    """``apply`` with scalars to lift, tensors of other worlds, or an ambient world."""
    world: World | None = None
    ref = None
    like = None  # a payload not in numpy (on the GPU, or a tracer): where lifted constants go
    for x in inputs:
        if isinstance(x, Tensor):
            d = x._data
            if type(d) is not np.ndarray:
                like = d
                w = _WORLDS.get(type(d))
                if w is not None and w is not world:
                    if world is not None and not world.captures:
                        if not w.captures:
                            raise OpError(
                                f"{spec.name}: cannot mix {world.name} and {w.name} tensors in one op"
                            )
                        world = w
                    elif world is None:
                        world = w
            if ref is None and d.dtype != _BOOL:
                ref = d.dtype
    if world is None or (not world.captures and current_world().captures):
        # inside a trace, tensors of a world that does not capture (distributed ones) are captured
        # like concrete ones: an op reading only those is still part of the program
        world = current_world()

    payloads: list[Any] = []
    lifted = False
    for x in inputs:
        if isinstance(x, Tensor):
            payloads.append(x._data)
        elif x is None:
            raise OpError(f"{spec.name}: only trailing optional inputs may be None")
        else:
            lifted = True
            if isinstance(x, (list, tuple)) or B.is_array(x):
                arr = np.asarray(x) if isinstance(x, (list, tuple)) else x
                payloads.append(world.constant(arr, B.dtype(arr.dtype), like))
            else:
                payloads.append(world.constant(x, _scalar_dtype(spec, x, ref), like))
    outs = world.run(spec, payloads, attrs, inputs)
    return _record(spec, inputs, outs, attrs, payloads if lifted else None)


def _record(spec: OpSpec, inputs: tuple, outs: Any, attrs: dict[str, Any], lifted: list | None = None) -> Any:
    """Wrap an op's payloads in Tensors; record its autograd node where an input needs a gradient
    (``lifted``: the payloads of inputs that were lifted constants, which the node holds as Tensors)."""
    if spec.multi_output:
        result: Any = tuple([_wrap(o) for o in outs])
        wrapped = result
    else:
        result = _wrap(outs)
        wrapped = (result,)
    if spec.vjp is None or not grad_mode.enabled:
        return result
    nondiff = spec.nondiff
    for i, x in enumerate(inputs):
        if isinstance(x, Tensor) and x.requires_grad and i not in nondiff:
            break
    else:
        return result
    if lifted is not None:
        inputs = tuple(x if isinstance(x, Tensor) else _wrap(p) for x, p in zip(inputs, lifted))
    node = Node(spec, inputs, attrs, tuple([_wrap(t._data) for t in wrapped]))
    floating = B.FLOAT_DTYPES
    for i, t in enumerate(wrapped):
        if t._data.dtype in floating:
            t.requires_grad = True
            t._node = node
            t._out_idx = i
    return result


_wrap = Tensor._wrap


# ------------------------------------------------------------------------------ op functions

_PUBLIC: dict[str, Callable[..., Any]] = {}


def public(spec: OpSpec) -> Callable[..., Any]:
    """The user-facing function of an op (made once, cached)."""
    fn = _PUBLIC.get(spec.name)
    if fn is None:
        fn = _make_public(spec)
        _PUBLIC[spec.name] = fn
    return fn


def _make_public(spec: OpSpec) -> Callable[..., Any]:
    names = spec.input_names
    attr_names = tuple(a.name for a in spec.attrs)
    variadic = spec.variadic
    n_in = 1 if variadic else len(names)

    def fn(*args: Any, **kw: Any) -> Any:
        n = len(args)
        if n == n_in and not variadic:  # the common call: the inputs, attributes by keyword
            return _apply(spec, args, kw)
        if n > n_in:
            extra = args[n_in:]
            if len(extra) > len(attr_names):
                raise OpError(f"{spec.name}: too many positional arguments ({len(args)})")
            for k, v in zip(attr_names, extra):
                if k in kw:
                    raise OpError(f"{spec.name}: got attribute {k!r} twice")
                kw[k] = v
            args = args[:n_in]
        inputs = list(args)
        if len(inputs) < n_in:
            for nm in names[len(inputs) :]:
                if nm in kw:
                    inputs.append(kw.pop(nm))
                else:
                    inputs.append(None)
        if spec.variadic:
            xs = inputs[0]
            if xs is None or not isinstance(xs, (list, tuple)):
                raise OpError(f"{spec.name}: expects a list of tensors as its first argument")
            return _apply(spec, tuple(xs), kw)
        return _apply(spec, tuple(inputs), kw)

    params = []
    if spec.variadic:
        params.append(inspect.Parameter(names[0], inspect.Parameter.POSITIONAL_OR_KEYWORD))
    else:
        for raw, nm in zip(spec.inputs, names):
            default = None if raw.endswith("?") else inspect.Parameter.empty
            params.append(inspect.Parameter(nm, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
    for a in spec.attrs:
        default = inspect.Parameter.empty if a.default is REQUIRED else a.default
        params.append(inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__name__ = fn.__qualname__ = spec.name
    fn.__doc__ = (
        f"{spec.doc}\n\nop {spec.name!r} ({spec.kind})" if spec.doc else f"op {spec.name!r} ({spec.kind})"
    )
    fn.spec = spec  # type: ignore[attr-defined]
    return fn


class _OpFunctions:
    """``O.<name>``: op ``<name>``'s public function, looked up when called (rules of one op call
    others that may be declared after it)."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = public(get(name))
        setattr(self, name, fn)  # found without this lookup from now on
        return fn


O = _OpFunctions()
