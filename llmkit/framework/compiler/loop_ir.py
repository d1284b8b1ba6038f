"""The loop IR: a fusion group as loops, loads, stores, reductions and local temporaries.

Expressions are immutable and compared by structure (equal trees are equal dict keys), so the
lowering shares work by memoizing on them. Index arithmetic stays *affine* where it can:
:class:`Affine` is ``{loop variable: coefficient} + constant`` whose coefficients and constant are
symbolic dims (``symbolic`` polynomials over the kernel's size and stride arguments). That is what
lets the scheduler merge loops and see contiguous accesses; ``//``, ``%``, ``min``, ``max`` and
comparisons are :class:`Bin` nodes. Value expressions are :class:`Load`, :class:`Call` (an
op-table C template such as ``"({0}+{1})"``), :class:`Cast`, :class:`Select`, :class:`Const` and
:class:`Ref` (a local temporary, an accumulator or a derived index).

Statements: :class:`Loop` (``serial``, ``parallel`` or ``vector``), :class:`Let` (a local),
:class:`Decl` / :class:`Accum` / :class:`Finish` (one accumulator of a reduction, scalar or one per
vector lane), :class:`Store`. ``str(kernel)`` prints the whole kernel for debugging.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .. import symbolic as sym
from ..symbolic import Dim

I64 = np.dtype(np.int64)
BOOL = np.dtype(np.bool_)


class Expr:
    """Base of expressions: a dtype and a structural key (equality and hash follow the key)."""

    __slots__ = ("_h", "_k", "dtype")

    def __init__(self, dtype: np.dtype, key: tuple) -> None:
        self.dtype = dtype
        self._k = (type(self).__name__, dtype.str, *key)
        self._h = hash(self._k)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Expr) and self._h == other._h and self._k == other._k)

    def __hash__(self) -> int:
        return self._h

    def __repr__(self) -> str:
        return render(self, PRETTY)

    # Index arithmetic, so the op table's index maps read as plain Python (``out[a] - ix.dim(off)``).
    def __add__(self, o: Any) -> Expr:
        return add(self, o)

    __radd__ = __add__

    def __sub__(self, o: Any) -> Expr:
        return add(self, mul(as_index(o), -1))

    def __rsub__(self, o: Any) -> Expr:
        return add(as_index(o), mul(self, -1))

    def __mul__(self, o: Any) -> Expr:
        return mul(self, o)

    __rmul__ = __mul__

    def __floordiv__(self, o: Any) -> Expr:
        return floordiv(self, as_index(o))

    def __mod__(self, o: Any) -> Expr:
        return mod(self, as_index(o))

    def __lt__(self, o: Any) -> Expr:  # type: ignore[override]
        return Bin("<", self, as_index(o), BOOL)

    def __ge__(self, o: Any) -> Expr:  # type: ignore[override]
        return Bin(">=", self, as_index(o), BOOL)


class Const(Expr):
    __slots__ = ("value",)

    def __init__(self, value: Any, dtype: np.dtype) -> None:
        v = bool(value) if dtype == BOOL else (int(value) if dtype.kind in "iu" else float(value))
        self.value = v
        super().__init__(dtype, (repr(v),))


class Affine(Expr):
    """sum(coef * var) + const over int64; coefficients and const are dims (int or polynomial)."""

    __slots__ = ("const", "terms")

    def __init__(self, terms: tuple[tuple[str, Dim], ...] = (), const: Dim = 0) -> None:
        self.terms = terms
        self.const = const
        super().__init__(I64, (terms, const))

    @property
    def is_const(self) -> bool:
        return not self.terms

    def coef(self, var: str) -> Dim:
        for v, c in self.terms:
            if v == var:
                return c
        return 0


class Load(Expr):
    __slots__ = ("buf", "index")

    def __init__(self, buf: str, index: Expr, dtype: np.dtype) -> None:
        self.buf, self.index = buf, index
        super().__init__(dtype, (buf, index))


class Call(Expr):
    """An op-table C template applied to arguments: ``Call("exp({0})", (x,), f32)``."""

    __slots__ = ("args", "template")

    def __init__(self, template: str, args: tuple[Expr, ...], dtype: np.dtype) -> None:
        self.template, self.args = template, args
        super().__init__(dtype, (template, args))


class Cast(Expr):
    __slots__ = ("x",)

    def __init__(self, x: Expr, dtype: np.dtype) -> None:
        self.x = x
        super().__init__(dtype, (x,))


class Select(Expr):
    __slots__ = ("a", "b", "cond")

    def __init__(self, cond: Expr, a: Expr, b: Expr) -> None:
        self.cond, self.a, self.b = cond, a, b
        super().__init__(a.dtype, (cond, a, b))


class Bin(Expr):
    """Integer and comparison operators: ``/`` (floor, on non-negative ints), ``%``, ``min``, ``max``,
    ``<``, ``>=``, ``&&``."""

    __slots__ = ("a", "b", "op")

    def __init__(self, op: str, a: Expr, b: Expr, dtype: np.dtype = I64) -> None:
        self.op, self.a, self.b = op, a, b
        super().__init__(dtype, (op, a, b))


class Ref(Expr):
    """A named local: a Let temporary, an accumulator or a derived loop index."""

    __slots__ = ("name",)

    def __init__(self, name: str, dtype: np.dtype) -> None:
        self.name = name
        super().__init__(dtype, (name,))


# ---- index arithmetic --------------------------------------------------------------------------


def var(name: str) -> Affine:
    return Affine(((name, 1),), 0)


def as_index(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, (int, np.integer, str)):
        return Affine((), sym.canonical(int(x) if not isinstance(x, str) else x))
    raise TypeError(f"not an index: {x!r}")


def _is_dim(x: Any) -> bool:
    return isinstance(x, (int, np.integer, str)) or (isinstance(x, Affine) and x.is_const)


def _dim_of(x: Any) -> Dim:
    return x.const if isinstance(x, Affine) else sym.canonical(int(x) if not isinstance(x, str) else x)


def add(a: Any, b: Any) -> Expr:
    a, b = as_index(a), as_index(b)
    if isinstance(b, Affine) and b.is_const and b.const == 0:
        return a
    if isinstance(a, Affine) and a.is_const and a.const == 0:
        return b
    if isinstance(a, Affine) and isinstance(b, Affine):
        terms = dict(a.terms)
        for v, c in b.terms:
            terms[v] = sym.add(terms.get(v, 0), c)
        return Affine(tuple(sorted((v, c) for v, c in terms.items() if c != 0)), sym.add(a.const, b.const))
    return Bin("+", a, b)


def mul(a: Any, k: Any) -> Expr:
    if _is_dim(a) and not _is_dim(k):
        a, k = k, a
    a = as_index(a)
    if _is_dim(k) and _dim_of(k) == 1:
        return a
    if _is_dim(k) and isinstance(a, Affine):
        d = _dim_of(k)
        if d == 0:
            return Affine((), 0)
        return Affine(tuple((v, sym.mul(c, d)) for v, c in a.terms), sym.mul(a.const, d))
    return Bin("*", a, as_index(k))


def floordiv(a: Expr, b: Expr) -> Expr:
    if isinstance(b, Affine) and b.is_const and b.const == 1:
        return a
    consts = isinstance(a, Affine) and isinstance(b, Affine) and a.is_const and b.is_const
    if consts and isinstance(a.const, int) and isinstance(b.const, int):
        return Affine((), a.const // b.const)
    return Bin("/", a, b)


def mod(a: Expr, b: Expr) -> Expr:
    if isinstance(b, Affine) and b.is_const and b.const == 1:
        return Affine((), 0)
    return Bin("%", a, b)


def clamp(x: Expr, hi: Dim) -> Expr:
    """x clamped into [0, hi - 1] (loads of a Select's unchosen side stay in bounds)."""
    top = as_index(sym.sub(hi, 1))
    return Bin("max", Bin("min", x, top), Affine((), 0))


def free_vars(e: Expr, out: set[str] | None = None) -> set[str]:
    """Names of loop variables and locals an expression reads."""
    out = set() if out is None else out
    if isinstance(e, Affine):
        out.update(v for v, _ in e.terms)
    elif isinstance(e, Ref):
        out.add(e.name)
    else:
        for c in children(e):
            free_vars(c, out)
    return out


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Load):
        return (e.index,)
    if isinstance(e, Call):
        return e.args
    if isinstance(e, Cast):
        return (e.x,)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    if isinstance(e, Bin):
        return (e.a, e.b)
    return ()


def substitute(e: Expr, fn: Any) -> Expr:
    """Rebuild ``e`` bottom-up, replacing each node n by ``fn(n)`` (None keeps it)."""
    memo: dict[Expr, Expr] = {}

    def go(x: Expr) -> Expr:
        if x in memo:
            return memo[x]
        if isinstance(x, Load):
            y: Expr = Load(x.buf, go(x.index), x.dtype)
        elif isinstance(x, Call):
            y = Call(x.template, tuple(go(a) for a in x.args), x.dtype)
        elif isinstance(x, Cast):
            y = Cast(go(x.x), x.dtype)
        elif isinstance(x, Select):
            y = Select(go(x.cond), go(x.a), go(x.b))
        elif isinstance(x, Bin):
            a, b = go(x.a), go(x.b)
            y = add(a, b) if x.op == "+" else mul(a, b) if x.op == "*" else Bin(x.op, a, b, x.dtype)
        else:
            y = x
        r = fn(y)
        memo[x] = y if r is None else r
        return memo[x]

    return go(e)


# ---- statements --------------------------------------------------------------------------------


@dataclass
class Loop:
    var: str
    extent: Expr
    body: list = field(default_factory=list)
    kind: str = "serial"  # serial | parallel (threads / blocks) | vector (SIMD lanes / CUDA threads)
    start: Expr = field(default_factory=lambda: Affine((), 0))
    prefetch: list = field(default_factory=list)  # Loads of the next parallel iteration to fetch
    # while this loop's streamed stores run (``schedule.mark_streams``)


@dataclass
class Let:
    name: str
    value: Expr


@dataclass
class Decl:
    """An accumulator with the reducer's identity; ``lanes`` > 0 makes it one per vector lane."""

    name: str
    dtype: np.dtype
    reducer: str  # sum | max | min
    lanes: int = 0


@dataclass
class Accum:
    name: str
    reducer: str
    value: Expr
    lane: str | None = None  # the lane index for per-lane accumulators


@dataclass
class Finish:
    """After its loop: a max/min accumulator that saw a NaN becomes NaN (numpy propagates NaN)."""

    name: str
    reducer: str
    lanes: int = 0


@dataclass
class Store:
    buf: str
    index: Expr
    value: Expr
    stream: bool = False  # an output written once, along its vector loop, never read back: may
    # bypass the caches when large (``schedule.mark_streams``, ``codegen_c``)


@dataclass
class Param:
    name: str
    kind: str  # in | out | size
    dtype: np.dtype
    shape: tuple = ()  # in kernel dims (for printing and the runtime)


@dataclass
class Kernel:
    name: str
    params: list[Param]
    body: list
    label: str = ""  # readable origin ("rms_norm"), for profiles
    schedule: str = ""  # the schedule that made it

    def __str__(self) -> str:
        return print_kernel(self)


# ---- rendering expressions (shared by the printer and the C / CUDA backends) -------------------


class Lang:
    """How a backend spells constants, types and dims; subclassed by each backend."""

    names: ClassVar[dict[str, str]] = {
        "float64": "f64", "float32": "f32", "int64": "i64", "int32": "i32", "int16": "i16",
        "int8": "i8", "uint8": "u8", "bool": "bool",
    }  # fmt: skip

    def ctype(self, dt: np.dtype) -> str:
        return self.names[dt.name]

    def const(self, c: Const) -> str:
        v = c.value
        if isinstance(v, float):
            if v != v:
                return "nan"
            if v in (float("inf"), float("-inf")):
                return "inf" if v > 0 else "-inf"
            return repr(v)
        return str(int(v))

    def dim(self, d: Dim) -> str:
        return str(d)

    def ref(self, name: str) -> str:
        return name


PRETTY = Lang()


def render_dim(d: Dim, lang: Lang) -> str:
    """A dim polynomial as an expression over the kernel's size symbols."""
    if isinstance(d, int):
        return str(d)
    parts = []
    for mono, c in sorted(sym.poly(d).items(), key=lambda kv: (-len(kv[0]), kv[0])):
        factors = [lang.dim(s) for s in mono]
        if c != 1 or not factors:
            factors.insert(0, str(abs(c)) if factors else str(c))
        term = "*".join(factors)
        parts.append(("-" if c < 0 and mono else "+", term))
    text = "".join(f"{s}{t}" for s, t in parts)
    text = text[1:] if text.startswith("+") else text
    return f"({text})" if len(parts) > 1 or "*" in text else text


def render(e: Expr, lang: Lang) -> str:
    if isinstance(e, Const):
        return lang.const(e)
    if isinstance(e, Ref):
        return lang.ref(e.name)
    if isinstance(e, Affine):
        parts = []
        for v, c in e.terms:
            parts.append(lang.ref(v) if c == 1 else f"{render_dim(c, lang)}*{lang.ref(v)}")
        if e.const != 0 or not parts:
            parts.append(render_dim(e.const, lang))
        return parts[0] if len(parts) == 1 else "(" + " + ".join(parts) + ")"
    if isinstance(e, Load):
        return f"{e.buf}[{render(e.index, lang)}]"
    if isinstance(e, Call):
        args = [render(a, lang) for a in e.args]
        return e.template.format(*args, ctype=lang.ctype(e.dtype))
    if isinstance(e, Cast):
        return f"(({lang.ctype(e.dtype)}){render(e.x, lang)})"
    if isinstance(e, Select):
        return f"({render(e.cond, lang)} ? {render(e.a, lang)} : {render(e.b, lang)})"
    if isinstance(e, Bin):
        a, b = render(e.a, lang), render(e.b, lang)
        if e.op in ("min", "max"):
            return f"{lang.ref('imin' if e.op == 'min' else 'imax')}({a}, {b})"
        return f"({a} {e.op} {b})"
    raise TypeError(f"cannot render {type(e).__name__}")


# ---- the printer -------------------------------------------------------------------------------

_IDENTITY_TEXT = {"sum": "0", "max": "-inf", "min": "+inf"}


class _Lanes(Lang):
    """The printer's spelling, with per-lane accumulators read at the lane index."""

    def __init__(self, lanes: dict[str, str]) -> None:
        self.lanes = lanes

    def ref(self, name: str) -> str:
        return f"{name}[{self.lanes[name]}]" if name in self.lanes else name


def print_kernel(k: Kernel) -> str:
    lanes = {}
    for s in walk_stmts(k.body):
        if isinstance(s, Accum) and s.lane:
            lanes[s.name] = s.lane
    lang = _Lanes(lanes)
    sig = []
    for p in k.params:
        if p.kind == "size":
            sig.append(f"size {p.name}")
        else:
            shape = ", ".join(str(d) for d in p.shape)
            sig.append(f"{p.kind} {p.name}: {lang.ctype(p.dtype)}[{shape}]")
    head = (
        f"kernel {k.name}"
        + (f" [{k.label}]" if k.label else "")
        + (f" schedule={k.schedule} " if k.schedule else "")
    )
    lines = [f"{head}(" + ", ".join(sig) + ")"]
    _print_body(k.body, 1, lines, lang)
    return "\n".join(lines) + "\n"


def _print_body(body: list, depth: int, lines: list[str], lang: Lang) -> None:
    pad = "  " * depth
    for s in body:
        if isinstance(s, Loop):
            kind = "" if s.kind == "serial" else s.kind + " "
            start = render(s.start, lang)
            ahead = "".join(f" prefetch {render(ld, lang)}" for ld in s.prefetch)
            lines.append(f"{pad}{kind}for {s.var} in {start}..{render(s.extent, lang)}:{ahead}")
            _print_body(s.body, depth + 1, lines, lang)
        elif isinstance(s, Let):
            lines.append(f"{pad}{s.name}: {lang.ctype(s.value.dtype)} = {render(s.value, lang)}")
        elif isinstance(s, Decl):
            lanes = f"[{s.lanes}]" if s.lanes else ""
            lines.append(
                f"{pad}{s.name}{lanes}: {lang.ctype(s.dtype)} = {_IDENTITY_TEXT[s.reducer]}  ({s.reducer})"
            )
        elif isinstance(s, Accum):
            tgt = lang.ref(s.name)
            op = {"sum": "+=", "max": "max=", "min": "min="}[s.reducer]
            lines.append(f"{pad}{tgt} {op} {render(s.value, lang)}")
        elif isinstance(s, Finish):
            pass  # NaN bookkeeping: not worth a line when reading a kernel
        elif isinstance(s, Store):
            streamed = "  (stream)" if s.stream else ""
            lines.append(f"{pad}{s.buf}[{render(s.index, lang)}] = {render(s.value, lang)}{streamed}")
        else:
            raise TypeError(f"unknown statement {s!r}")


def walk_stmts(body: list):
    """Every statement, nested ones included (pre-order)."""
    for s in body:
        yield s
        if isinstance(s, Loop):
            yield from walk_stmts(s.body)
