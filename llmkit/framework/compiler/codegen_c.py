"""C backend: the loop IR as C99 with OpenMP pragmas.

Every kernel has one signature, so the runtime calls all of them the same way::

    void k_<hash>(void **bufs, const int64_t *sizes, int64_t nthreads)

``bufs`` holds the inputs then the outputs, ``sizes`` the size (and stride) symbols. ``parallel``
loops become ``omp parallel for`` (taken only when the work is large enough to pay for waking the
threads), ``vector`` loops ``omp simd`` with ``reduction`` clauses for their accumulators — that is
what lets the compiler vectorize a sum or a max without ``-ffast-math`` (which would also break
NaN and inf). Math calls go through ``<tgmath.h>`` (the op table's templates are type-generic);
``exp``/``log``/``tanh``/... are declared ``omp declare simd`` so the vectorizer calls glibc's
vector math library (libmvec, within a few ulp, IEEE special cases included) where it exists.
"""

from __future__ import annotations

import numpy as np

from . import loop_ir as L

CTYPES = {
    "float64": "double", "float32": "float", "int64": "int64_t", "int32": "int32_t", "int16": "int16_t",
    "int8": "int8_t", "uint8": "uint8_t", "bool": "bool",
}  # fmt: skip
_INT_LIMITS = {
    "int64": ("INT64_MIN", "INT64_MAX"), "int32": ("INT32_MIN", "INT32_MAX"),
    "int16": ("INT16_MIN", "INT16_MAX"), "int8": ("INT8_MIN", "INT8_MAX"), "uint8": ("0", "UINT8_MAX"),
}  # fmt: skip
MIN_PARALLEL_WORK = 1 << 15  # elements below which a kernel runs on the calling thread

SIMD_MATH = ("exp", "log", "tanh", "erf", "sin", "cos")

PRELUDE = (
    r"""#include <stdint.h>
#include <stdbool.h>
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
    """Renders one :class:`~.loop_ir.Kernel` as a C function."""

    lang: L.Lang = CLang()

    def __init__(self, kernel: L.Kernel) -> None:
        self.k = kernel
        self.lanes: dict[str, int] = {}  # per-lane accumulators -> lanes
        self.lane_var: dict[str, str] = {}
        self.dtypes: dict[str, np.dtype] = {}

    def render(self) -> str:
        k = self.k
        ins = [p for p in k.params if p.kind == "in"]
        outs = [p for p in k.params if p.kind == "out"]
        sizes = [p for p in k.params if p.kind == "size"]
        lines = [f"/* {k.label or 'fusion'}: schedule {k.schedule} */"]
        lines.append(f"void {k.name}(void **bufs, const int64_t *sizes, int64_t nthreads) {{")
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
        # threads only for work worth waking them (an if() clause would cost the serial path its SIMD)
        work = self.expr(k.work) if hasattr(k, "work") else "0"
        lines.append(f"  const int nt = ({work} >= {MIN_PARALLEL_WORK}) ? (int)nthreads : 1;")
        lines.append("  (void)nt; (void)sizes;")
        self.body(k.body, 1, lines)
        lines.append("}")
        return "\n".join(lines) + "\n"

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
            elif isinstance(s, L.Decl):
                self.decl(s, pad, lines)
            elif isinstance(s, L.Accum):
                self.accum(s, pad, lines)
            elif isinstance(s, L.Finish):
                self.finish(s, pad, lines)
            elif isinstance(s, L.Store):
                lines.append(f"{pad}{s.buf}[{self.expr(s.index)}] = {self.expr(s.value)};")
            else:
                raise TypeError(f"unknown statement {s!r}")

    def pragma(self, loop: L.Loop) -> str | None:
        par = "schedule(static) num_threads(nt)"
        if loop.kind == "parallel":
            return f"#pragma omp parallel for {par}"
        if loop.kind == "parallel_vector":
            return f"#pragma omp parallel for simd {par}"
        if loop.kind == "vector":
            clauses = []
            for s in loop.body:
                if isinstance(s, L.Accum) and s.lane is None:
                    op = {"sum": "+", "max": "max", "min": "min"}[s.reducer]
                    clauses.append(f"reduction({op}:{s.name})")
                    if s.reducer != "sum" and self.dtypes.get(s.name, np.dtype("f4")).kind == "f":
                        clauses.append(f"reduction(|:{s.name}_nan)")
            return "#pragma omp simd " + " ".join(clauses)
        return None

    def loop(self, s: L.Loop, depth: int, lines: list[str]) -> None:
        pad = "  " * depth
        p = self.pragma(s)
        if p:
            lines.append(pad + p)
        lo, hi = self.expr(s.start), self.expr(s.extent)
        lines.append(f"{pad}for (int64_t {s.var} = {lo}; {s.var} < {hi}; {s.var}++) {{")
        self.body(s.body, depth + 1, lines)
        lines.append(pad + "}")

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


def render_c(kernel: L.Kernel) -> str:
    """The C source of one kernel (without the prelude)."""
    return CRenderer(kernel).render()
