"""CUDA backend: the same loop IR (``rows`` schedule) as CUDA C, compiled with cupy (NVRTC).

The loop kinds map onto the GPU as the schedule intends: a ``parallel`` loop over rows is a
grid-stride loop over blocks, a ``vector`` loop is a block-stride loop over the threads of a block
(its accumulators are combined with a warp-shuffle block reduction, so every thread sees the
row's result), a ``parallel_vector`` loop (flat elementwise) is a grid-stride loop over all
threads. Values stored once per row are written by thread 0. Kernels take their buffers and
sizes as plain arguments and are cached per source by cupy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import symbolic as sym
from . import loop_ir as L
from .codegen_c import CRenderer, identity

THREADS = 256

PRELUDE = r"""typedef long long int64_t; typedef int int32_t; typedef short int16_t;
typedef signed char int8_t; typedef unsigned char uint8_t;
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#define INT64_C(x) x##LL
#define INT64_MIN (-9223372036854775807LL - 1)
#define INT64_MAX 9223372036854775807LL
#define INT32_MIN (-2147483647 - 1)
#define INT32_MAX 2147483647
#define INT16_MIN (-32768)
#define INT16_MAX 32767
#define INT8_MIN (-128)
#define INT8_MAX 127
#define UINT8_MAX 255
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
struct RSum { template <class T> __device__ T operator()(T a, T b) const { return a + b; } };
struct RMax { template <class T> __device__ T operator()(T a, T b) const { return b > a ? b : a; } };
struct RMin { template <class T> __device__ T operator()(T a, T b) const { return b < a ? b : a; } };
struct ROr { __device__ int operator()(int a, int b) const { return a | b; } };
template <class T, class F> __device__ T block_reduce(T v, F op) {
  __shared__ T sh[32];
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  T r = sh[0];
  for (int w = 1; w < (int)((blockDim.x + 31) >> 5); w++) r = op(r, sh[w]);
  __syncthreads();
  return r;
}
"""

_REDUCERS = {"sum": "RSum()", "max": "RMax()", "min": "RMin()"}


class CudaRenderer(CRenderer):
    """Renders a ``rows``-scheduled kernel as a CUDA ``__global__`` function."""

    def render(self) -> str:
        k = self.k
        params = []
        for p in k.params:
            t = self.lang.ctype(p.dtype)
            if p.kind == "in":
                params.append(f"const {t} *__restrict__ {p.name}")
            elif p.kind == "out":
                params.append(f"{t} *__restrict__ {p.name}")
            else:
                params.append(f"const int64_t {self.lang.dim(p.name)}")
        lines = [f'extern "C" __global__ void {k.name}({", ".join(params)}) {{']
        self.depth_in_rows = 0
        self.body(k.body, 1, lines)
        lines.append("}")
        return "\n".join(lines) + "\n"

    def body(self, stmts: list, depth: int, lines: list[str]) -> None:
        pad = "  " * depth
        decls = {s.name: s for s in stmts if isinstance(s, L.Decl)}
        last: dict[str, int] = {}  # accumulator -> the last statement here that accumulates into it
        for i, s in enumerate(stmts):
            if isinstance(s, L.Loop):
                for a in L.walk_stmts(s.body):
                    if isinstance(a, L.Accum) and a.name in decls:
                        last[a.name] = i
        for i, s in enumerate(stmts):
            if isinstance(s, L.Store) and not self.in_threads:
                lines.append(
                    f"{pad}if (threadIdx.x == 0) {s.buf}[{self.expr(s.index)}] = {self.expr(s.value)};"
                )
                continue
            super().body([s], depth, lines)
            for name in [n for n, j in last.items() if j == i]:  # combine the threads' partial results
                d = decls[name]
                lines.append(f"{pad}{name} = block_reduce({name}, {_REDUCERS[d.reducer]});")
                if d.reducer != "sum" and d.dtype.kind == "f":
                    lines.append(f"{pad}{name}_nan = block_reduce({name}_nan, ROr());")

    in_threads = False

    def loop(self, s: L.Loop, depth: int, lines: list[str]) -> None:
        pad = "  " * depth
        v, lo, hi = s.var, self.expr(s.start), self.expr(s.extent)
        if s.kind == "parallel":
            head = f"for (int64_t {v} = {lo} + blockIdx.x; {v} < {hi}; {v} += gridDim.x) {{"
        elif s.kind == "parallel_vector":
            head = (
                f"for (int64_t {v} = {lo} + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; {v} < {hi}; "
                f"{v} += (int64_t)blockDim.x * gridDim.x) {{"
            )
        elif s.kind == "vector":
            head = f"for (int64_t {v} = {lo} + threadIdx.x; {v} < {hi}; {v} += blockDim.x) {{"
        else:
            head = f"for (int64_t {v} = {lo}; {v} < {hi}; {v}++) {{"
        lines.append(pad + head)
        was = self.in_threads
        self.in_threads = was or s.kind in ("vector", "parallel_vector")
        self.body(s.body, depth + 1, lines)
        self.in_threads = was
        lines.append(pad + "}")

    def decl(self, s: L.Decl, pad: str, lines: list[str]) -> None:
        t = self.lang.ctype(s.dtype)
        self.dtypes[s.name] = s.dtype
        nan = s.reducer != "sum" and s.dtype.kind == "f"
        lines.append(
            f"{pad}{t} {s.name} = {identity(s.reducer, s.dtype, self.lang)};"
            + (f" int {s.name}_nan = 0;" if nan else "")
        )


def render_cuda(kernel: L.Kernel) -> str:
    return PRELUDE + CudaRenderer(kernel).render()


def launch_shape(kernel: L.Kernel, env: dict[str, int]) -> tuple[int, int]:
    """(blocks, threads) for a kernel: a block per row (capped), or enough blocks for every element."""
    top = [s for s in kernel.body if isinstance(s, L.Loop)]
    if not top:
        return 1, THREADS
    loop = top[0]
    n = (
        sym.evaluate(loop.extent.const, env)
        if isinstance(loop.extent, L.Affine) and loop.extent.is_const
        else 1 << 16
    )
    if loop.kind == "parallel_vector":
        return max(1, min(-(-n // THREADS), 1 << 16)), THREADS
    if loop.kind == "parallel":
        return max(1, min(n, 1 << 16)), THREADS
    return 1, THREADS


def kernel_for(fk: Any) -> Any:
    """A callable ``(xp, arrays) -> outputs`` running ``fk``'s group on the GPU, or None."""
    hit = getattr(fk, "cuda", None)
    if hit is not None:
        return hit
    try:
        import cupy
    except ImportError:
        return None
    from .loop_schedule import build
    from .lower import lower

    low = lower(fk.fusion)
    k = build(low, "k_cuda", "rows")
    raw = cupy.RawKernel(render_cuda(k), "k_cuda")
    names = low.sizes[: low.num_sizes]

    def run(xp: Any, arrays: tuple) -> Any:
        if fk.head is not None:
            kern, args, hattrs = fk.head
            arrays = (*arrays, kern(xp, *[arrays[i] for i in args], **hattrs))
        arrays = tuple(xp.ascontiguousarray(a) for a in arrays)
        sizes = [arrays[i].shape[a] for i, a in low.size_sources]
        env = dict(zip(names, sizes))
        outs = [xp.empty(tuple(sym.evaluate(d, env) for d in shape), dt) for _, dt, shape in low.outputs]
        grid, block = launch_shape(k, env)
        raw((grid,), (block,), (*arrays, *outs, *[np.int64(s) for s in sizes]))
        return outs[0] if len(outs) == 1 else tuple(outs)

    fk.cuda = run  # built once per group
    return run
