"""Running fused groups: the executor's lowering of ``cinn.fusion`` to a compiled kernel.

:func:`compile_fusions` lowers every group of a program, renders each candidate schedule as C,
builds them all in one go and keeps a :class:`FusedKernel` per fusion op, which the executor finds
through ``LOWERINGS["cinn.fusion"]``. A FusedKernel is called like an op-table kernel,
``(xp, *arrays) -> outputs``: it binds the size symbols from the arrays' shapes (one kernel serves
every batch size and sequence length), allocates the outputs, runs the matmul head if there is
one (its elementwise epilogue then writes in place), and calls the schedule the tuner picked for
this shape class. Inputs that are not contiguous get a variant compiled with stride arguments.
On GPU arrays it runs the CUDA rendering of the same loop IR; without a kernel it runs the group's
ops with the reference kernels.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import weakref
from typing import Any

import numpy as np

from .. import symbolic as sym
from ..executor import _PROFILE, LOWERINGS
from ..ir import Operation, Program
from ..ir.interpreter import run_group
from . import build, tune
from .build import CPUS
from .codegen_c import MIN_PARALLEL_WORK, render_c
from .loop_schedule import build as build_kernel
from .loop_schedule import coalesce, strategies
from .lower import Lowered, LowerError, lower

_KERNELS: weakref.WeakKeyDictionary[Operation, FusedKernel] = weakref.WeakKeyDictionary()
PLACEHOLDER = "KERNEL_FN"


def kernel_sources(low: Lowered) -> list[tuple[str, str, str, Any]]:
    """(schedule, kernel name, C source, loop-IR kernel) for each candidate schedule of a group."""
    out = []
    for strategy, tile in strategies(coalesce(low)):
        k = build_kernel(low, PLACEHOLDER, strategy, tile)
        src = render_c(k)
        body = src.split("\n", 1)[1]  # the first line is a comment naming the group
        name = build.kernel_name(body)
        k.name = name
        out.append((f"{strategy}{tile or ''}", name, src.replace(PLACEHOLDER, name), k))
    return out


class Variant:
    """The compiled candidates of a group for one input layout, with their tuning decisions."""

    def __init__(self, low: Lowered, cands: list[tuple[str, str, Any]]) -> None:
        self.labels = [c[0] for c in cands]
        self.names = [c[1] for c in cands]
        self.fns = [c[2] for c in cands]
        self.strided = [(k, a) for k, i in enumerate(low.inputs) if i.strided for a in range(len(i.shape))]
        self.work = sym.product(ax.extent for ax in low.axes)
        self.sizes = low.sizes
        self.choices: dict[tuple, tuple[int, int]] = {}

    def choose(self, sizes: list[int], env: dict[str, int], call) -> tuple[int, int]:
        cls = tuple(int(s).bit_length() for s in sizes)
        hit = self.choices.get(cls)
        if hit is None:
            work = sym.evaluate(self.work, env)
            threads = [1, CPUS] if CPUS > 1 and work >= MIN_PARALLEL_WORK else [1]
            key = f"{self.names[0]}|{tune.shape_class(sizes)}|{CPUS}"
            hit = self.choices[cls] = tune.choose(key, len(self.fns), threads, call)
        return hit


class FusedKernel:
    """A compiled fusion group, called as ``(xp, *arrays, **attrs) -> output(s)``."""

    def __init__(self, fusion: Operation, low: Lowered, cands: list[tuple[str, str, Any]]) -> None:
        self.fusion = fusion
        self.label = low.label
        self.profile_name = f"cinn.fusion[{low.label}]"  # what LLMKIT_PROFILE shows
        self.outputs = low.outputs
        self.size_names = low.sizes[: low.num_sizes]
        self.size_sources = low.size_sources
        self.inplace = low.inplace
        self.head = None
        if low.head is not None:
            pos = {v: i for i, v in enumerate(fusion.operands)}
            h = low.head
            self.head = (h.opdef.spec.kernel, [pos[v] for v in h.operands], dict(h.plain_attrs))
        self.cuda = None  # the GPU rendering, built on first use (cuda.kernel_for)
        layout = tuple(not i.strided for i in low.inputs)
        self.variants: dict[tuple, Variant | None] = {layout: Variant(low, cands)}
        self._plans: dict[tuple, tuple] = {}  # (shapes, strides) of the inputs -> what to call

    def __call__(self, xp: Any, *arrays: Any, **attrs: Any) -> Any:
        if xp is not np:
            return self.device(xp, arrays)
        prod = None
        if self.head is not None:
            kernel, args, hattrs = self.head
            prod = kernel(np, *[arrays[i] for i in args], **hattrs)
            arrays = (*arrays, prod)
        key = tuple((a.shape, a.strides) for a in arrays)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key, arrays)
        contiguous, fn, sz, threads, out_specs = plan
        if contiguous:
            arrays = tuple(np.ascontiguousarray(a) for a in arrays)
        reuse = prod is not None and prod.flags.c_contiguous  # the matmul head's output, written in place
        outs = [prod if reuse and j == self.inplace else np.empty(s, t) for j, (s, t) in enumerate(out_specs)]
        bufs = (ctypes.c_void_p * (len(arrays) + len(outs)))(*[a.ctypes.data for a in (*arrays, *outs)])
        fn(bufs, sz, threads)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def native_call(self, arrays: tuple) -> tuple[Any, Any, int, list] | None:
        """(C function, size arguments, threads, output (shape, dtype)s) of a call on these arrays,
        for the executor's replays (``native/run.py``); None when the call needs Python (a matmul head,
        inputs to copy)."""
        if self.head is not None:
            return None
        key = tuple((a.shape, a.strides) for a in arrays)
        contiguous, fn, sz, threads, out_specs = self._plans.get(key) or self._plan(key, arrays)
        return None if contiguous else (fn, sz, threads, out_specs)

    def _plan(self, key: tuple, arrays: tuple) -> tuple:
        """What a call with these shapes and strides runs (kernel, size arguments, threads, outputs);
        worked out once per shape, so later calls only allocate outputs and call the kernel."""
        layout = tuple(a.flags.c_contiguous for a in arrays)
        var = self.variants.get(layout, False)
        if var is False:
            var = self.variants[layout] = self._variant(layout)
        contiguous = var is None  # no kernel for this layout: make the inputs contiguous
        if contiguous:
            arrays = tuple(np.ascontiguousarray(a) for a in arrays)
            var = self.variants[tuple(True for _ in arrays)]
        sizes = [arrays[k].shape[a] for k, a in self.size_sources]
        env = dict(zip(self.size_names, sizes))
        sizes += [arrays[k].strides[a] // arrays[k].itemsize for k, a in var.strided]
        out_specs = [(tuple(sym.evaluate(d, env) for d in shape), dt) for _, dt, shape in self.outputs]
        probe = [np.empty(shape, dt) for shape, dt in out_specs]
        bufs = (ctypes.c_void_p * (len(arrays) + len(probe)))(*[a.ctypes.data for a in (*arrays, *probe)])
        sz = (ctypes.c_int64 * max(1, len(sizes)))(*sizes)
        fns = var.fns
        cand, threads = var.choose(sizes, env, lambda c, t: fns[c](bufs, sz, t))
        plan = self._plans[key] = (contiguous, fns[cand], sz, threads, out_specs)
        return plan

    def _variant(self, layout: tuple[bool, ...]) -> Variant | None:
        try:
            low = lower(self.fusion, layout)
        except LowerError:
            return None
        cands = kernel_sources(low)
        fns = build.build({n: s for _, n, s, _ in cands})
        ok = [(lbl, n, fns[n]) for lbl, n, _, _ in cands if fns[n] is not None]
        return Variant(low, ok) if ok else None

    def device(self, xp: Any, arrays: tuple) -> Any:
        from . import cuda

        fn = cuda.kernel_for(self)
        if fn is not None:
            return fn(xp, arrays)
        build.warn_once(
            f"no-cuda:{self.label}", f"cinn: group {self.label} runs the reference kernels on {xp.__name__}"
        )
        return run_group(self.fusion, xp, arrays)  # no CUDA kernel: the group's ops one by one


def compile_fusions(*programs: Program) -> int:
    """Lower and build every ``cinn.fusion`` of the programs (one build for all); returns how many
    groups got a kernel (the others run their ops with the reference kernels)."""
    return compile_groups([op for p in programs for f in p.functions.values() for op in f.body
                           if op.name == "cinn.fusion"])  # fmt: skip


def compile_groups(groups: list[Operation]) -> int:
    pending = []
    sources: dict[str, str] = {}
    dump = os.environ.get("LLMKIT_CINN_DUMP")
    for op in groups:
        if op in _KERNELS:
            continue
        try:
            low = lower(op)
        except LowerError as e:
            name = op.attributes["name"].value if "name" in op.attributes else "?"
            build.warn_once(f"unfused:{name}", f"cinn: group {name} runs the reference kernels: {e}")
            continue
        cands = kernel_sources(low)
        pending.append((op, low, cands))
        for _, n, s, k in cands:
            sources[n] = s
            if dump:
                os.makedirs(dump, exist_ok=True)
                with open(os.path.join(dump, f"{n}.txt"), "w") as fh:
                    fh.write(f"{k}\n{s}")
    fns = build.build(sources)
    n = 0
    for op, low, cands in pending:
        ok = [(lbl, name, fns[name]) for lbl, name, _, _ in cands if fns[name] is not None]
        if ok:
            _KERNELS[op] = FusedKernel(op, low, ok)
            n += 1
    return n


def _lower_fusion(op: Operation) -> Any:
    """``LOWERINGS["cinn.fusion"]``: the op's kernel (compiled now if needed), or None (run unfused)."""
    if op not in _KERNELS:
        if build.toolchain() is None:
            build.warn_once("no-cc", NO_CC)
            return None
        compile_groups([op])  # a group met without compile_program (a program fused elsewhere)
    return _KERNELS.get(op)


NO_CC = (
    "cinn: no working C compiler (set CC or LLMKIT_CC, or install gcc/clang); static programs run "
    "the reference kernels unfused"
)

LOWERINGS["cinn.fusion"] = _lower_fusion


def _report() -> None:
    s = build.STATS
    if s.compiled or s.cached or s.failed:
        print(
            f"cinn: {s.compiled} kernels compiled in {s.seconds:.2f} s, {s.cached} loaded from the cache, "
            f"{s.failed} failed ({build.cache_dir()})",
            file=sys.stderr,
        )


if _PROFILE:
    atexit.register(_report)
