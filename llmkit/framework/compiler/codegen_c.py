"""C backend: the loop IR as C99, its threads from the kernels' own pool (``par.py``).

Every kernel has one signature, so the runtime calls all of them the same way::

    void k_<hash>(void **bufs, const int64_t *sizes, int64_t nthreads)

``bufs`` holds the inputs then the outputs, ``sizes`` the size (and stride) symbols. A ``parallel``
loop becomes a function of one chunk of its iterations, which the kernel hands to the pool
(``llmkit_par_run``: the caller and the helpers claim chunks; threads only for work worth waking
them); ``vector`` loops become ``omp simd`` with ``reduction`` clauses for their accumulators —
that is what lets the compiler vectorize a sum or a max without ``-ffast-math`` (which would also
break NaN and inf). Only OpenMP's SIMD pragmas are used (``-fopenmp-simd``: no OpenMP runtime).
Math calls go through ``<tgmath.h>`` (the op table's templates are type-generic);
``exp``/``log``/``tanh``/... are declared ``omp declare simd`` so the vectorizer calls glibc's
vector math library (libmvec, within a few ulp, IEEE special cases included) where it exists.

A store the scheduler marked ``stream`` (an output written once, contiguously, never read back)
goes through a run of ``LLMKIT_RUN`` bytes in L1 and then to memory with non-temporal stores when
the output is at least ``STREAM_BYTES``: a plain store reads each line before writing it, which
for an output larger than the caches costs a third of the traffic (a copy streams too).
"""

from __future__ import annotations

import os

import numpy as np

from . import loop_ir as L
from . import par

CTYPES = {
    "float64": "double", "float32": "float", "int64": "int64_t", "int32": "int32_t", "int16": "int16_t",
    "int8": "int8_t", "uint8": "uint8_t", "bool": "bool",
}  # fmt: skip
_INT_LIMITS = {
    "int64": ("INT64_MIN", "INT64_MAX"), "int32": ("INT32_MIN", "INT32_MAX"),
    "int16": ("INT16_MIN", "INT16_MAX"), "int8": ("INT8_MIN", "INT8_MAX"), "uint8": ("0", "UINT8_MAX"),
}  # fmt: skip
MIN_PARALLEL_WORK = 1 << 15  # elements below which a kernel runs on the calling thread
CHUNK_WORK = 1 << 14  # elements of work per claim of the pool, at least ...
CLAIMS_PER_THREAD = 64  # ... and at most this many claims per thread: a helper the OS sets aside
# holds up the caller for the rest of its claim only


def _last_level_cache() -> int:
    """Bytes of the last-level cache (32 MiB where the system does not say)."""
    for level in ("index3", "index2"):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/{level}/size") as f:
                text = f.read().strip()
            return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
        except (OSError, ValueError, KeyError):
            continue
    return 32 << 20


# an output at least half the last-level cache streams: it and an input as large do not fit together
STREAM_BYTES = int(os.environ.get("LLMKIT_STREAM_BYTES", 0)) or _last_level_cache() // 2

SIMD_MATH = ("exp", "log", "tanh", "erf", "sin", "cos")

PRELUDE = (
    r"""#include <stdint.h>
#include <stdbool.h>
#include <string.h>
#include <math.h>
#ifdef LLMKIT_MVEC
#define SIMD _Pragma("omp declare simd notinbranch")
"""
    + "".join(f"SIMD float {f}f(float);\nSIMD double {f}(double);\n" for f in SIMD_MATH)
    + r"""SIMD float powf(float, float);
SIMD double pow(double, double);
#endif
#include <tgmath.h>
static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
"""
    + par.DECLARE
    + f"""
enum {{ LLMKIT_CHUNK_WORK = {CHUNK_WORK}, LLMKIT_CLAIMS = {CLAIMS_PER_THREAD}, LLMKIT_RUN = 1024 }};
#define LLMKIT_STREAM_BYTES INT64_C({STREAM_BYTES})
"""
    + r"""/* a parallel loop's chunk function reads the kernel's arguments from here */
typedef struct { void **bufs; const int64_t *sizes; int64_t per; } llmkit_loop;

/* iterations per claim of a parallel loop of n iterations and `work` elements in all (a multiple
   of `align`): at least LLMKIT_CHUNK_WORK elements, at most LLMKIT_CLAIMS claims per thread */
static inline int64_t llmkit_per(int64_t n, int64_t work, int64_t nt, int64_t align) {
  if (nt < 2 || n < 2) return n > 0 ? n : 1;
  const int64_t each = work / n > 0 ? work / n : 1, claims = LLMKIT_CLAIMS * nt;
  const int64_t fewest = (n + claims - 1) / claims;
  int64_t per = (LLMKIT_CHUNK_WORK + each - 1) / each;
  per = (per > fewest ? per : fewest) + align - 1;
  return per - per % align;
}

#ifdef __SSE2__
#include <emmintrin.h>
#endif
/* elements (of `size` bytes) of the next run of a streamed store to dst: up to LLMKIT_RUN bytes,
   ending on a 64-byte boundary, so that the runs after the first start on one */
static inline int64_t llmkit_run(const void *dst, int64_t size, int64_t left) {
  const int64_t room = (LLMKIT_RUN - (int64_t)((uintptr_t)dst & 63)) / size;
  return left < room ? left : room;
}

/* n bytes of src (a run, in L1) to dst: whole 64-byte lines with non-temporal stores (to memory,
   past the caches, without reading the line first), the partial lines around them plainly */
static inline void llmkit_stream(void *dst, const void *src, int64_t n) {
  char *d = (char *)dst;
  const char *s = (const char *)src;
#ifdef __SSE2__
  int64_t head = (int64_t)(-(uintptr_t)d & 63);
  head = head < n ? head : n;
  memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 64; n -= 64, d += 64, s += 64)
    for (int k = 0; k < 64; k += 16)
      _mm_stream_si128((__m128i *)(d + k), _mm_loadu_si128((const __m128i *)(s + k)));
#endif
  memcpy(d, s, n);
}

/* after a thread's streamed stores, before another thread may read them */
static inline void llmkit_stream_fence(void) {
#ifdef __SSE2__
  _mm_sfence();
#endif
}
"""
)


class CLang(L.Lang):
    def ctype(self, dt: np.dtype) -> str:
        return CTYPES[dt.name]

    def const(self, c: L.Const) -> str:
        v, dt = c.value, c.dtype
        if dt.kind == "b":
            return "1" if v else "0"
        if dt.kind == "f":
            t = self.ctype(dt)
            if v != v:
                return f"(({t})NAN)"
            if v in (float("inf"), float("-inf")):
                return f"(({t})INFINITY)" if v > 0 else f"(-({t})INFINITY)"
            return f"(({t}){v!r})"
        if dt.name == "int64":
            return "INT64_MIN" if v == -(2**63) else f"INT64_C({v})"
        return f"(({self.ctype(dt)}){v})"

    def dim(self, d: str) -> str:
        return f"s_{d}"


def identity(reducer: str, dt: np.dtype, lang: L.Lang) -> str:
    if reducer == "sum":
        return f"(({lang.ctype(dt)})0)"
    if dt.kind == "f":
        return f"(-({lang.ctype(dt)})INFINITY)" if reducer == "max" else f"(({lang.ctype(dt)})INFINITY)"
    lo, hi = _INT_LIMITS[dt.name]
    return lo if reducer == "max" else hi


class CRenderer:
    """Renders one :class:`~.loop_ir.Kernel` as a C function (and a function per parallel loop)."""

    lang: L.Lang = CLang()

    def __init__(self, kernel: L.Kernel) -> None:
        self.k = kernel
        self.lanes: dict[str, int] = {}  # per-lane accumulators -> lanes
        self.lane_var: dict[str, str] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.chunks: list[str] = []  # the parallel loops' chunk functions, rendered
        self.lets: list[str] = []  # the kernel's top-level locals so far (chunk functions repeat them)
        self.runs: dict[str, tuple[str, str]] = {}  # in a streamed loop: buffer -> (run buffer, loop var)
        self.top: list[str] | None = None  # the kernel function's top level, while it renders
        self.par_var: str | None = None  # the parallel loop of the chunk function rendering
        self.streams = [s for s in L.walk_stmts(kernel.body) if isinstance(s, L.Store) and s.stream]

    def arguments(self) -> list[str]:
        """The kernel's arguments as locals (the kernel and each chunk function begin with them)."""
        k = self.k
        ins = [p for p in k.params if p.kind == "in"]
        outs = [p for p in k.params if p.kind == "out"]
        sizes = [p for p in k.params if p.kind == "size"]
        lines = []
        for i, p in enumerate(ins):
            t = self.lang.ctype(p.dtype)
            r = "" if p.name in getattr(k, "aliased", ()) else "restrict "
            lines.append(f"  const {t} *{r}{p.name} = (const {t} *)bufs[{i}];")
        for i, p in enumerate(outs):
            t = self.lang.ctype(p.dtype)
            r = "" if p.name in getattr(k, "aliased", ()) else "restrict "
            lines.append(f"  {t} *{r}{p.name} = ({t} *)bufs[{len(ins) + i}];")
        for i, p in enumerate(sizes):
            lines.append(f"  const int64_t {self.lang.dim(p.name)} = sizes[{i}];")
        if self.streams:  # the streamed outputs are large enough to bypass the caches
            big = []
            for p in outs:
                if any(s.buf == p.name for s in self.streams):
                    numel = "*".join(f"(int64_t){L.render_dim(d, self.lang)}" for d in p.shape) or "1"
                    big.append(f"{numel} * (int64_t)sizeof(*{p.name}) >= LLMKIT_STREAM_BYTES")
            lines.append(f"  const int streaming = {' || '.join(big)};")
        return lines

    def render(self) -> str:
        k = self.k
        lines = [f"void {k.name}(void **bufs, const int64_t *sizes, int64_t nthreads) {{", *self.arguments()]
        # threads only for work worth waking them
        work = self.expr(k.work) if hasattr(k, "work") else "0"
        lines.append(f"  const int64_t work = {work}, nt = (work >= {MIN_PARALLEL_WORK}) ? nthreads : 1;")
        lines.append("  (void)nt; (void)sizes;")
        self.top = lines
        self.body(k.body, 1, lines)
        self.top = None
        if self.streams:
            lines.append("  if (streaming) llmkit_stream_fence();")
        lines.append("}")
        head = f"/* {k.label or 'fusion'}: schedule {k.schedule} */"
        return "\n".join([head, *self.chunks, *lines]) + "\n"

    def expr(self, e: L.Expr) -> str:
        if isinstance(e, L.Ref) and e.name in self.lanes:
            return f"{e.name}[{self.lane_var[e.name]}]"
        if isinstance(e, (L.Ref, L.Const, L.Affine, L.Load)):
            return self._expr(e)
        return self._expr(e)

    def _expr(self, e: L.Expr) -> str:
        # render children through self.expr (per-lane accumulators), the rest as loop_ir.render does
        if isinstance(e, L.Ref):
            return self.expr(e) if e.name in self.lanes else e.name
        if isinstance(e, L.Call):
            return e.template.format(*[self.expr(a) for a in e.args], ctype=self.lang.ctype(e.dtype))
        if isinstance(e, L.Cast):
            return f"(({self.lang.ctype(e.dtype)}){self.expr(e.x)})"
        if isinstance(e, L.Select):
            return f"({self.expr(e.cond)} ? {self.expr(e.a)} : {self.expr(e.b)})"
        if isinstance(e, L.Bin):
            a, b = self.expr(e.a), self.expr(e.b)
            if e.op in ("min", "max"):
                return f"i{e.op}({a}, {b})"
            return f"({a} {e.op} {b})"
        if isinstance(e, L.Load):
            return f"{e.buf}[{self.expr(e.index)}]"
        return L.render(e, self.lang)

    # ---- statements ----------------------------------------------------------------------------
    def body(self, stmts: list, depth: int, lines: list[str]) -> None:
        pad = "  " * depth
        for s in stmts:
            if isinstance(s, L.Loop):
                self.loop(s, depth, lines)
            elif isinstance(s, L.Let):
                self.dtypes[s.name] = s.value.dtype
                # bool locals as int: one-byte lanes next to 32-bit floats defeat the vectorizer
                t = "int" if s.value.dtype == L.BOOL else self.lang.ctype(s.value.dtype)
                lines.append(f"{pad}const {t} {s.name} = {self.expr(s.value)};")
                if lines is self.top:
                    self.lets.append(lines[-1])
            elif isinstance(s, L.Decl):
                self.decl(s, pad, lines)
            elif isinstance(s, L.Accum):
                self.accum(s, pad, lines)
            elif isinstance(s, L.Finish):
                self.finish(s, pad, lines)
            elif isinstance(s, L.Store) and s.buf in self.runs:
                run, v = self.runs[s.buf]
                lines.append(f"{pad}{run}[{v} - {v}_at] = {self.expr(s.value)};")
            elif isinstance(s, L.Store):
                lines.append(f"{pad}{s.buf}[{self.expr(s.index)}] = {self.expr(s.value)};")
            else:
                raise TypeError(f"unknown statement {s!r}")

    def pragma(self, loop: L.Loop, kind: str) -> str | None:
        if kind != "vector":
            return None
        clauses = []
        for s in loop.body:
            if isinstance(s, L.Accum) and s.lane is None:
                op = {"sum": "+", "max": "max", "min": "min"}[s.reducer]
                clauses.append(f"reduction({op}:{s.name})")
                if s.reducer != "sum" and self.dtypes.get(s.name, np.dtype("f4")).kind == "f":
                    clauses.append(f"reduction(|:{s.name}_nan)")
        return "#pragma omp simd " + " ".join(clauses)

    def loop(self, s: L.Loop, depth: int, lines: list[str], bounds: tuple[str, str] | None = None) -> None:
        kind = s.kind
        if kind in ("parallel", "parallel_vector"):
            if lines is self.top:
                self.parallel(s, lines)
                return
            kind = "vector" if kind == "parallel_vector" else "serial"  # a chunk's own iterations
        pad = "  " * depth
        lo, hi = bounds or (self.expr(s.start), self.expr(s.extent))
        streamed = [x for x in s.body if isinstance(x, L.Store) and x.stream] if kind == "vector" else []
        if streamed:
            lines.append(f"{pad}if (streaming) {{")
            self.streamed(s, streamed, depth + 1, lines, lo, hi)
            lines.append(f"{pad}}} else {{")
            depth, pad = depth + 1, pad + "  "
        p = self.pragma(s, kind)
        if p:
            lines.append(pad + p)
        lines.append(f"{pad}for (int64_t {s.var} = {lo}; {s.var} < {hi}; {s.var}++) {{")
        self.body(s.body, depth + 1, lines)
        lines.append(pad + "}")
        if streamed:
            lines.append("  " * (depth - 1) + "}")

    def parallel(self, s: L.Loop, lines: list[str]) -> None:
        """A top-level parallel loop: a function computing one chunk of its iterations, which the
        kernel hands to the thread pool (``llmkit_par_run``)."""
        fn = f"{self.k.name}_par{len(self.chunks)}"
        lo, hi = self.expr(s.start), self.expr(s.extent)
        align = 16 if s.kind == "parallel_vector" else 1  # flat loops: chunks of whole cache lines
        chunk = [
            f"static void {fn}(void *loop_, int64_t chunk, int64_t worker) {{",
            "  const llmkit_loop *loop = (const llmkit_loop *)loop_;",
            "  void **bufs = loop->bufs;",
            "  const int64_t *sizes = loop->sizes;",
            "  (void)worker; (void)sizes;",
            *self.arguments(),
            *self.lets,
            f"  const int64_t lo = {lo} + chunk * loop->per, hi = imin(lo + loop->per, {hi});",
        ]
        top, self.top = self.top, None  # the chunk's loop and everything in it: plain loops
        self.par_var = s.var
        self.loop(s, 1, chunk, bounds=("lo", "hi"))
        self.top, self.par_var = top, None
        if self.streams:
            chunk.append("  if (streaming) llmkit_stream_fence();")
        chunk.append("}")
        self.chunks.append("\n".join(chunk))
        lines += [
            "  {",
            f"    const int64_t n = {hi} - {lo};",
            f"    const llmkit_loop loop = {{bufs, sizes, llmkit_per(n, work, nt, {align})}};",
            f"    llmkit_par_run(n > 0 ? (n + loop.per - 1) / loop.per : 0, nt, {fn}, (void *)&loop);",
            "  }",
        ]

    def streamed(self, s: L.Loop, stores: list, depth: int, lines: list[str], lo: str, hi: str) -> None:
        """The loop ``s`` in runs: each computes its values into run buffers (in L1), which
        ``llmkit_stream`` then writes out past the caches."""
        pad, v = "  " * depth, s.var
        bufs = list(dict.fromkeys(x.buf for x in stores))
        params = {p.name: p for p in self.k.params}
        size = max(params[b].dtype.itemsize for b in bufs)
        lead = next(b for b in bufs if params[b].dtype.itemsize == size)
        at = {x.buf: self.expr(_rename(x.index, v, f"{v}_at")) for x in stores}
        lines.append(f"{pad}for (int64_t {v}_at = {lo}; {v}_at < {hi};) {{")
        lines.append(f"{pad}  const int64_t {v}_n = llmkit_run(&{lead}[{at[lead]}], {size}, {hi} - {v}_at);")
        for b in bufs:
            t = self.lang.ctype(params[b].dtype)
            lines.append(f"{pad}  {t} run_{b}[LLMKIT_RUN / {size}] __attribute__((aligned(64)));")
        self.runs = {b: (f"run_{b}", v) for b in bufs}
        lines.append(f"{pad}  {self.pragma(s, 'vector')}")
        lines.append(f"{pad}  for (int64_t {v} = {v}_at; {v} < {v}_at + {v}_n; {v}++) {{")
        self.body(s.body, depth + 2, lines)
        lines.append(f"{pad}  }}")
        self.runs = {}
        if s.prefetch and self.par_var:  # the next row's inputs, into L2, while this row streams out
            step = {ld.buf: 64 // ld.dtype.itemsize for ld in s.prefetch}
            lines.append(f"{pad}  if ({self.par_var} + 1 < hi) {{")
            for ld in s.prefetch:
                ix = self.expr(_rename(ld.index, v, f"{v}_at"))
                lines.append(
                    f"{pad}    for (int64_t pf = 0; pf < {v}_n; pf += {step[ld.buf]}) "
                    f"__builtin_prefetch(&{ld.buf}[{ix} + pf], 0, 2);"
                )
            lines.append(f"{pad}  }}")
        for b in bufs:
            lines.append(f"{pad}  llmkit_stream(&{b}[{at[b]}], run_{b}, {v}_n * (int64_t)sizeof(*{b}));")
        lines.append(f"{pad}  {v}_at += {v}_n;")
        lines.append(f"{pad}}}")

    def decl(self, s: L.Decl, pad: str, lines: list[str]) -> None:
        t = self.lang.ctype(s.dtype)
        self.dtypes[s.name] = s.dtype
        init = identity(s.reducer, s.dtype, self.lang)
        nan = s.reducer != "sum" and s.dtype.kind == "f"
        if s.lanes:
            self.lanes[s.name] = s.lanes
            lines.append(f"{pad}{t} {s.name}[{s.lanes}];" + (f" int {s.name}_nan[{s.lanes}];" if nan else ""))
            fill = f"{s.name}[l] = {init};" + (f" {s.name}_nan[l] = 0;" if nan else "")
            lines.append(f"{pad}for (int l = 0; l < {s.lanes}; l++) {{ {fill} }}")
        else:
            lines.append(f"{pad}{t} {s.name} = {init};" + (f" int {s.name}_nan = 0;" if nan else ""))

    def accum(self, s: L.Accum, pad: str, lines: list[str]) -> None:
        if s.lane is not None:
            self.lane_var[s.name] = s.lane
        tgt = f"{s.name}[{s.lane}]" if s.lane is not None else s.name
        nan = f"{s.name}_nan[{s.lane}]" if s.lane is not None else f"{s.name}_nan"
        v = self.expr(s.value)
        if s.reducer == "sum":
            lines.append(f"{pad}{tgt} += {v};")
            return
        cmp = ">" if s.reducer == "max" else "<"
        lines.append(f"{pad}{tgt} = ({v} {cmp} {tgt}) ? {v} : {tgt};")
        if self.dtypes[s.name].kind == "f":
            lines.append(f"{pad}{nan} |= ({v} != {v});")

    def finish(self, s: L.Finish, pad: str, lines: list[str]) -> None:
        t = self.lang.ctype(self.dtypes[s.name])
        if s.lanes:
            lines.append(
                f"{pad}for (int l = 0; l < {s.lanes}; l++) if ({s.name}_nan[l]) {s.name}[l] = ({t})NAN;"
            )
        else:
            lines.append(f"{pad}if ({s.name}_nan) {s.name} = ({t})NAN;")


def _rename(e: L.Expr, var: str, new: str) -> L.Expr:
    """``e`` with the loop variable ``var`` read as ``new``."""

    def fix(x: L.Expr) -> L.Expr | None:
        if isinstance(x, L.Affine) and x.coef(var):
            return L.Affine(tuple((new if n == var else n, c) for n, c in x.terms), x.const)
        return None

    return L.substitute(e, fix)


def render_c(kernel: L.Kernel) -> str:
    """The C source of one kernel (without the prelude)."""
    return CRenderer(kernel).render()
