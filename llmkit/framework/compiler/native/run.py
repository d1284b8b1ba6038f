"""Running hand-written C kernels: one op at a time, and replays of whole functions without Python.

An executor planned with ``native=True`` (every compiled program: ``jit.compile.executor_for``)
does two things the default executor does not (this module registers both with it):

* **Native kernels.** An op whose spec has a C kernel (``OpSpec.native``, from ``native/``:
  float32 ``tiled_linear``, the paged KV cache ops, ``index_select``, flash attention) runs it
  instead of its reference kernel. The choice is made once per op from the program's static
  types and attributes, so every call of the program runs the same kernels (batch invariance
  depends on it).
* **Replays.** When every step of the function is a C kernel (a native op or a compiled
  ``cinn.fusion``) or a view (a reshape, or a transpose that moves no data; a transpose that does,
  as prefill's attention heads, becomes a strided C copy), the executor plans it
  once per binding of its size symbols: a buffer for every intermediate, allocated once, each
  kernel's argument arrays filled in, and one C loop that calls the kernels in order. A call then
  only points the kernels at its inputs (those that changed since the last call) and at fresh
  output arrays, and makes one C call. The Python between ops is gone: 3-20 µs per op, more when
  the step's weights have pushed the interpreter out of the caches. The results are bitwise those
  of the op-by-op run (the same kernels on the same arguments).

A binding that cannot be replayed (a step without a C kernel, a movement op whose result is not a
view of its input, inputs that are not contiguous) runs op by op. So does a call while another
thread is inside the same executor's replay (replays own their buffers), and every call under
``LLMKIT_PROFILE=1``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...dispatch import register_eager_native
from ...executor import register_native
from ...ir import Operation
from ...opspec import Kind, Meta, Native, OpError, OpSpec, Trait
from .. import build
from ..build import CPUS
from . import products, pyext

log = logging.getLogger("llmkit.native")

_c_void_p, _c_int64 = ctypes.c_void_p, ctypes.c_int64
_BUILT: dict[str, Any] = {}  # kernel source -> ctypes function (None: no compiler, or it failed)
STATUS_WORDS = 3  # [error code, offending item, failing step]

LAUNCH = r"""
/* Calls a replay's kernels in order; stops at the first that reports an error in the status.
   bufs: kernel functions [n], their bufs arrays [n], their sizes arrays [n], threads [n], status. */
typedef void (*KERNEL_FN_kernel)(void **, const int64_t *, int64_t);
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  (void)nthreads;
  KERNEL_FN_kernel *fns = (KERNEL_FN_kernel *)bufs[0];
  void ***argv = (void ***)bufs[1];
  const int64_t **sizev = (const int64_t **)bufs[2];
  const int64_t *threads = (const int64_t *)bufs[3];
  int64_t *status = (int64_t *)bufs[4];
  for (int64_t i = 0; i < sizes[0]; i++) {
    fns[i](argv[i], sizev[i], threads[i]);
    if (status[0]) { status[2] = i; return; }
  }
}
"""

COPY = r"""
#include <string.h>
/* dst (C-contiguous) = the strided view of src: bufs: src, dst. sizes: ndim (<= 16), itemsize,
   byte offset of the view in src, shape[ndim], byte strides[ndim]. */
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) {
  (void)nthreads;
  const int64_t nd = sizes[0], item = sizes[1];
  const int64_t *shape = sizes + 3, *strides = sizes + 3 + nd;
  const char *src = (const char *)bufs[0] + sizes[2];
  char *dst = (char *)bufs[1];
  int64_t total = 1, idx[16] = {0};
  for (int64_t d = 0; d < nd; d++) total *= shape[d];
  if (total == 0) return;
  const int64_t inner = nd ? shape[nd - 1] : 1, step = nd ? strides[nd - 1] : item;
  for (int64_t o = 0; o < total / inner; o++) {
    const char *sp = src;
    for (int64_t d = 0; d + 1 < nd; d++) sp += idx[d] * strides[d];
    if (step == item) {
      memcpy(dst, sp, inner * item);
      dst += inner * item;
    } else if (item == 4) {
      for (int64_t i = 0; i < inner; i++, dst += 4) memcpy(dst, sp + i * step, 4);
    } else if (item == 8) {
      for (int64_t i = 0; i < inner; i++, dst += 8) memcpy(dst, sp + i * step, 8);
    } else {
      for (int64_t i = 0; i < inner; i++, dst += item) memcpy(dst, sp + i * step, item);
    }
    for (int64_t d = nd - 2; d >= 0; d--) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}
"""


def build_c(source: str) -> Any:
    """The ctypes function of a kernel source whose names start with ``KERNEL_FN`` (None when no C
    compiler works here, or this kernel failed to compile: the build warns once)."""
    if source not in _BUILT:
        fn = None
        if build.toolchain() is not None:
            name = build.kernel_name(source)
            fn = build.build({name: source.replace("KERNEL_FN", name)})[name]
        _BUILT[source] = fn
    return _BUILT[source]


def _threads() -> int:
    """Threads a kernel may use (the compiler's setting, ``LLMKIT_CINN_THREADS``); a kernel uses
    fewer where its work is small, and its results never depend on the number."""
    return CPUS


def _ptr(fn: Any) -> int:
    return ctypes.cast(fn, _c_void_p).value


def _metas(values: Sequence[Any]) -> list[Meta]:
    return [Meta(v.type.shape, v.type.dtype) for v in values]


def native_of(op: Operation) -> Native | None:
    """``op``'s hand-written kernel (``OpSpec.native``) when it applies to the op's static types and
    attributes: the kernel that runs it in compiled programs, and why ``decompose`` keeps it whole."""
    spec = op.opdef.spec
    n = None if spec is None else spec.native
    if n is None or any(a.symbolic for a in op.attributes.values()):
        return None
    return n if n.applies(*_metas(op.operands), **op.plain_attrs) else None


class NativeOp:
    """An op's C kernel, called like its reference kernel: ``(xp, *arrays, **attrs) -> output(s)``."""

    def __init__(self, spec: OpSpec, fn: Any) -> None:
        self.spec, self.fn = spec, fn
        self.profile_name = f"llm.{spec.name}[native]"  # what LLMKIT_PROFILE shows
        self.inplace = "inplace_input0" in spec.traits
        self.strided = spec.native.strided

    @classmethod
    def of(cls, op: Operation) -> NativeOp | None:
        """The native kernel of ``op`` (built now) when its spec has one that applies (``native_of``)."""
        n = native_of(op)
        if n is None:
            return None
        source = n.source(*_metas(op.operands), **op.plain_attrs) if callable(n.source) else n.source
        fn = build_c(source)
        return None if fn is None else cls(op.opdef.spec, fn)

    def outputs(self, arrays: Sequence[np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
        """Arrays for the results (input 0 itself for an op writing it in place)."""
        metas = self.spec.infer_meta(*[Meta(a.shape, a.dtype) for a in arrays], **attrs)
        outs = []
        for j, m in enumerate(metas if isinstance(metas, tuple) else (metas,)):
            a = arrays[0] if j == 0 and self.inplace and attrs.get("inplace") else None
            ok = a is not None and a.flags.c_contiguous and a.flags.writeable and a.shape == m.shape
            outs.append(a if ok else np.empty(m.shape, m.dtype))
        return outs

    def __call__(self, xp: Any, *arrays: Any, **attrs: Any) -> Any:
        if xp is not np:
            return self.spec.kernel(xp, *arrays, **attrs)
        if self.strided:  # read through their strides, in whole elements
            arrays = tuple(
                a if not any(s % a.itemsize for s in a.strides) else np.ascontiguousarray(a) for a in arrays
            )
        else:
            arrays = tuple(np.ascontiguousarray(a) for a in arrays)
        outs = self.outputs(arrays, attrs)
        status = np.zeros(STATUS_WORDS, np.int64)
        ptrs = [a.ctypes.data for a in (*arrays, *outs, status)]
        sizes = list(self.spec.native.sizes(*arrays, **attrs))
        self.fn((_c_void_p * len(ptrs))(*ptrs), (_c_int64 * max(1, len(sizes)))(*sizes), _threads())
        if status[0]:
            self.reject(arrays, attrs, status)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def reject(self, arrays: Sequence[np.ndarray], attrs: dict[str, Any], status: np.ndarray) -> None:
        """The kernel refused its inputs (before writing anything): raise the reference kernel's error."""
        self.spec.kernel(np, *arrays, **attrs)
        raise OpError(
            f"{self.spec.name}: invalid input (the C kernel's check {int(status[0])} failed at item "
            f"{int(status[1])}); the reference kernel accepted it: {', '.join(str(a.shape) for a in arrays)}"
        )


_EAGER: dict[Any, NativeOp | None] = {}


def eager_kernel(spec: OpSpec, arrays: Sequence[Any], attrs: dict[str, Any]) -> NativeOp | None:
    """The C kernel an eager op runs on these arrays' shapes, dtypes and attributes (chosen, and built,
    once per such call, as ``NativeOp.of`` chooses for a program's op); None for an engine op."""
    if not spec.native.eager or Trait.INFERENCE in spec.traits:
        return None
    if any(a is None or a.size == 0 for a in arrays):  # programs never hand kernels empty arrays
        return None
    key = (spec.name, *((a.shape, a.dtype) for a in arrays), repr(sorted(attrs.items())))
    if key not in _EAGER:
        n, metas = spec.native, [Meta(a.shape, a.dtype) for a in arrays]
        fn = None
        if n.applies(*metas, **attrs):
            fn = build_c(n.source(*metas, **attrs) if callable(n.source) else n.source)
        _EAGER[key] = None if fn is None else NativeOp(spec, fn)
    return _EAGER[key]


class _Unplannable(Exception):
    """A binding that cannot be replayed; the message says why (logged at INFO)."""


class Replay:
    """One function, planned for one binding of its size symbols (see the module docstring)."""

    def __init__(self, ex: Any, env: dict[str, int], inputs: Sequence[np.ndarray], replays: Replays) -> None:
        launch = build_c(LAUNCH)
        if launch is None:
            raise _Unplannable("no C compiler")
        self.status = np.zeros(STATUS_WORDS, np.int64)
        # Every slot lives at (base, byte offset) in a base: a function input, a constant, or a
        # buffer of the plan (allocated afresh at every call when the function returns it).
        bases: list[tuple[str, Any]] = []
        at: dict[int, tuple[int, int]] = {}
        arrays: dict[int, np.ndarray] = {}  # each slot's array while planning
        written: set[int] = set()  # bases a kernel writes in place

        def new_base(kind: str, what: Any) -> tuple[int, int]:
            bases.append((kind, what))
            return len(bases) - 1, 0

        for i, (s, x) in enumerate(zip(ex.input_slots, inputs)):
            if not x.flags.c_contiguous:
                raise _Unplannable(f"input %{ex.arg_names[i]} is not contiguous")
            at[s], arrays[s] = new_base("input", i), x
        for s, c in ex.consts:
            c = np.ascontiguousarray(c)
            at[s], arrays[s] = new_base("const", c), c
        uses: list[tuple[int, Any, int, int]] = []  # (base, bufs array, position, byte offset)
        life: dict[int, list[int]] = {}  # base -> [first, last] step using it
        calls: list[tuple[int, Any, Any, int]] = []  # (kernel address, bufs, sizes, threads)
        self.names: list[str] = []
        self.keep: list[Any] = []  # the ctypes arrays the C loop reads
        for st in ex.steps:
            attrs = st.attrs
            if st.sym_attrs:
                attrs = {**attrs, **{k: a.evaluate(env) for k, a in st.sym_attrs.items()}}
            args = [arrays[i] for i in st.ins]
            fn = st.fn
            if isinstance(fn, NativeOp):
                try:
                    outs = fn.outputs(args, attrs)
                    sizes = list(fn.spec.native.sizes(*args, **attrs))
                except (OpError, ValueError, TypeError) as e:  # the op-by-op run raises it properly
                    raise _Unplannable(f"{st.name}: {e}") from None
                kernel, threads, status = fn.fn, _threads(), [self.status]
                outs = [np.zeros(o.shape, o.dtype) if o is not args[0] else o for o in outs]
                out_at = [at[st.ins[0]] if o is args[0] else None for o in outs]
                written.update(a[0] for a in out_at if a is not None)
            elif hasattr(fn, "native_call"):  # a compiled fusion group (compiler/runtime.py)
                hit = fn.native_call(tuple(args))
                if hit is None:
                    raise _Unplannable(f"{st.name} has no plain C entry (a matmul head, or strided inputs)")
                kernel, sizes, threads, specs = hit
                outs = [np.zeros(shape, dt) for shape, dt in specs]
                out_at, status = [None] * len(outs), []
            else:
                copy = self._movement(st, args, attrs, at, arrays)
                if copy is None:
                    continue
                kernel, sizes, outs = copy
                threads, status, out_at = 1, [], [None]
            for s, o, where in zip(st.outs, outs, out_at):
                at[s], arrays[s] = where or new_base("buffer", o), o
            bufs = (_c_void_p * (len(args) + len(outs) + len(status)))()
            for pos, s in enumerate([*st.ins, *st.outs]):
                uses.append((*at[s], bufs, pos))
                life.setdefault(at[s][0], [len(calls), 0])[1] = len(calls)
            for pos, a in enumerate(status, len(args) + len(outs)):
                bufs[pos] = a.ctypes.data
            sz = sizes if isinstance(sizes, ctypes.Array) else (_c_int64 * max(1, len(sizes)))(*sizes)
            calls.append((_ptr(kernel), bufs, sz, threads))
            self.keep += [bufs, sz]
            self.names.append(st.name)
        self.outs = [self._output(s, at, arrays, bases, inputs) for s in ex.output_slots]
        fresh = {what for kind, what, _ in self.outs if kind == "fresh"}
        # Intermediates live in the executor's arena, packed by lifetime (see Replays.arena).
        inner = [(b, life[b], bases[b][1].nbytes) for b in life if bases[b][0] == "buffer" and b not in fresh]
        offsets = _pack(inner)
        arena = replays.arena(max((offsets[b] + n for b, _, n in inner), default=0))
        self.in_arena: list[tuple[Any, int, int]] = []  # (bufs, position, byte offset in the arena)
        # Fixed addresses go in now; inputs and fresh buffers are pointed to at every call.
        patches: dict[int, list[tuple[Any, int, int]]] = {}
        for base, off, bufs, pos in uses:
            kind, what = bases[base]
            if kind == "input" or base in fresh:
                patches.setdefault(base, []).append((bufs, pos, off))
            elif base in offsets:
                self.in_arena.append((bufs, pos, offsets[base] + off))
                bufs[pos] = arena.ctypes.data + offsets[base] + off
            else:
                bufs[pos] = what.ctypes.data + off
        self.inputs = [(bases[b][1], p, b in written) for b, p in patches.items() if bases[b][0] == "input"]
        self.fresh = {b: (bases[b][1].shape, bases[b][1].dtype, patches.get(b, [])) for b in fresh}
        self.last: dict[int, Any] = {}  # input index -> the array its kernels point to now
        n = len(calls)
        fns = (_c_void_p * n)(*[c[0] for c in calls])
        argv = (_c_void_p * n)(*[ctypes.addressof(c[1]) for c in calls])
        sizev = (_c_void_p * n)(*[ctypes.addressof(c[2]) for c in calls])
        threads = (_c_int64 * n)(*[c[3] for c in calls])
        self.keep += [fns, argv, sizev, threads]
        # the arrays the kernels point into live as long as the plan (the planning copies of the
        # intermediates go: the arena holds them)
        self.bases = [(k, None if b in offsets else w) for b, (k, w) in enumerate(bases)]
        self.launch = launch
        self.launch_bufs = (_c_void_p * 5)(
            ctypes.addressof(fns), ctypes.addressof(argv), ctypes.addressof(sizev),
            ctypes.addressof(threads), self.status.ctypes.data,
        )  # fmt: skip
        self.launch_sizes = (_c_int64 * 1)(n)

    @staticmethod
    def _movement(st: Any, args: list, attrs: dict, at: dict, arrays: dict) -> tuple | None:
        """A movement op whose result is a contiguous piece of its first input costs nothing (None);
        one whose result is a strided view of it (a transpose) becomes a copy: (kernel, sizes, [out])."""
        if st.kind != Kind.MOVEMENT or len(st.outs) != 1 or not args:
            raise _Unplannable(f"{st.name} has no C kernel")
        out, src = st.fn(np, *args, **attrs), args[0]
        if not isinstance(out, np.ndarray) or out.base is None or out.ndim > 16:
            raise _Unplannable(f"{st.name} would copy")
        off = out.ctypes.data - src.ctypes.data
        lo = off + sum(s * (n - 1) for s, n in zip(out.strides, out.shape) if s < 0 and n)
        hi = off + sum(s * (n - 1) for s, n in zip(out.strides, out.shape) if s > 0 and n) + out.itemsize
        if out.size and (lo < 0 or hi > src.nbytes or not np.shares_memory(out, src)):
            raise _Unplannable(f"{st.name} is not a view of its first input")
        if not out.flags.c_contiguous:
            copy = build_c(COPY)
            if copy is None:
                raise _Unplannable("no C compiler")
            sizes = [out.ndim, out.itemsize, off, *out.shape, *out.strides]
            return copy, sizes, [np.zeros(out.shape, out.dtype)]
        base, off0 = at[st.ins[0]]
        at[st.outs[0]], arrays[st.outs[0]] = (base, off0 + off), out
        return None

    @staticmethod
    def _output(s: int, at: dict, arrays: dict, bases: list, inputs: Sequence) -> tuple[str, Any, tuple]:
        """How a call produces output slot ``s``: an input given back (a pool written in place), a
        constant, or a buffer allocated afresh at every call (the caller keeps what it gets)."""
        (base, off), a = at[s], arrays[s]
        kind, what = bases[base]
        if kind == "input" and a is inputs[what]:
            return "input", what, a.shape
        if kind == "const" and a is what:
            return "const", what, a.shape
        if kind == "buffer" and off == 0 and a.nbytes == what.nbytes:
            return "fresh", base, a.shape
        raise _Unplannable("an output is a piece of an intermediate")

    def run(self, inputs: Sequence[np.ndarray]) -> list[Any] | None:
        """The outputs, or None when an input cannot be used as planned (the caller runs op by op)."""
        last = self.last
        for i, entries, written in self.inputs:
            x = inputs[i]
            if last.get(i) is x:
                continue
            if not x.flags.c_contiguous or (written and not x.flags.writeable):
                return None
            ptr = x.ctypes.data
            for bufs, pos, off in entries:
                bufs[pos] = ptr + off
            last[i] = x
        fresh = {}
        for base, (shape, dtype, entries) in self.fresh.items():
            a = fresh[base] = np.empty(shape, dtype)
            ptr = a.ctypes.data
            for bufs, pos, off in entries:
                bufs[pos] = ptr + off
        self.status[0] = 0
        self.launch(self.launch_bufs, self.launch_sizes, 1)
        if self.status[0]:
            raise _Failed(self.names[int(self.status[2])])
        outs = []
        for kind, what, shape in self.outs:
            a = inputs[what] if kind == "input" else what if kind == "const" else fresh[what]
            outs.append(a if a.shape == shape else a.reshape(shape))
        return outs


def _pack(buffers: list[tuple[int, list[int], int]]) -> dict[int, int]:
    """Byte offsets for buffers ``(id, [first, last] step, bytes)`` so that two whose steps overlap
    never overlap in memory: each takes the smallest gap between the live ones that fits (64-byte
    aligned), else the end."""
    offsets: dict[int, int] = {}
    live: list[tuple[int, int, int]] = []  # (last step, offset, bytes)
    for b, (first, last), n in sorted(buffers, key=lambda x: x[1][0]):
        live = [x for x in live if x[0] >= first]
        n = -(-n // 64) * 64
        best, best_gap, end = None, 0, 0
        for lo, hi in sorted((off, off + size) for _, off, size in live):
            if lo - end >= n and (best is None or lo - end < best_gap):
                best, best_gap = end, lo - end
            end = max(end, hi)
        offsets[b] = end if best is None else best
        live.append((last, offsets[b], n))
    return offsets


class _Failed(Exception):
    """A kernel of a replay rejected its inputs; the op-by-op run raises the op's own error."""


class Replays:
    """An executor's replays, one per binding of its size symbols (the most recent few)."""

    MAX = 16

    def __init__(self, ex: Any) -> None:
        self.ex = ex
        self.plans: OrderedDict[tuple, Replay | None] = OrderedDict()
        self.lock = threading.Lock()
        self._arena = np.zeros(0, np.uint8)

    def arena(self, nbytes: int) -> np.ndarray:
        """The memory every plan's intermediates live in: plans never run at once (the lock), so
        they share it, and the executor holds its largest plan's intermediates, not the sum over
        its bindings (a prefill of every chunk length). When a plan needs more, a larger one
        replaces it and the other plans' kernels are pointed into that."""
        if nbytes > self._arena.nbytes:
            self._arena = np.zeros(0, np.uint8)  # the old one goes before the new one comes
            self._arena = np.zeros(nbytes, np.uint8)
            for plan in self.plans.values():
                for bufs, pos, off in plan.in_arena if plan is not None else ():
                    bufs[pos] = self._arena.ctypes.data + off
        return self._arena

    def run(self, env: dict[str, int], inputs: Sequence[Any]) -> list[Any] | None:
        """The function's outputs by replay, or None: run it op by op."""
        for x in inputs:
            if type(x) is not np.ndarray:
                return None
        if not self.lock.acquire(blocking=False):
            return None  # another thread is replaying this function: its buffers are taken
        try:
            key = tuple(env.items())
            plan = self.plans.get(key, False)
            if plan is False:
                plan = self._plan(key, env, inputs)
            if plan is None:
                return None
            try:
                return plan.run(inputs)
            except _Failed as e:
                log.info("native: %s rejected its inputs; running op by op for the error", e)
                return None
        finally:
            self.lock.release()

    def _plan(self, key: tuple, env: dict[str, int], inputs: Sequence[Any]) -> Replay | None:
        try:
            plan = Replay(self.ex, env, inputs, self)
        except _Unplannable as e:
            log.info("native: @%s %s runs op by op: %s", self.ex.name, dict(env), e)
            plan = None
        self.plans[key] = plan
        if len(self.plans) > self.MAX:
            self.plans.popitem(last=False)
        return plan


def kernel_of(op: Operation) -> Any:
    """What a compiled program runs ``op`` with: its hand-written C kernel, or for a product of
    matrices the row blocks of ``products.py``, or None (its reference kernel)."""
    return NativeOp.of(op) or products.kernel_of(op)


register_native(kernel_of, Replays)
register_eager_native(eager_kernel)
pyext.install()
