"""``loop_schedule``: turn a lowered group into loops.

Two steps, both readable on the printed loop IR:

1. :func:`coalesce` merges adjacent axes of the domain (both kept or both reduced) when every index
   expression walks them as one: ``c_a == c_b * extent_b`` for each access. ``[B, S, H]``
   elementwise becomes one loop; ``x[B, S, H] + w[H]`` keeps two (``w`` does not walk ``B, S``).
2. :func:`build` makes the loop nest for a strategy:

   - ``rows``: the kept axes are one flattened ``parallel`` loop (the thread pool / CUDA blocks);
     inside it, one pass over the reduced axes per level of dependent reductions (softmax: max,
     then the sum), then a pass storing the per-element outputs, then the per-row outputs. The
     innermost loop is ``vector`` (``omp simd`` with reduction clauses / CUDA threads).
   - ``cols`` (C only), for reductions whose last domain axis is kept (a weight gradient summed
     over rows): the parallel loop covers tiles of ``tile`` columns; each pass walks the reduced
     rows serially and a ``vector`` loop over the tile's lanes, with one accumulator per lane, so
     loads stay contiguous.

Each expression is bound to a local (``Let``) at the outermost loop where everything it reads is
defined: loop-invariant work (an AdamW step's bias corrections, a row's ``rsqrt``) is hoisted,
and values shared by several uses are computed once.

Two rewrites on the way: a sum of ``x * (t == i)`` over the reduced axis is a pick of ``x`` at
``t`` (:func:`_picks`: cross entropy reads the label's logit, not the row), and the equal pieces of
a split concat become one loop (:func:`merge_pieces`: SwiGLU's backward computes its sigmoid once).

Last, :func:`mark_streams` marks the stores that may bypass the caches (an output written once,
contiguously, never read back) and, in a row loop, the next row's inputs to prefetch meanwhile.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from .. import symbolic as sym
from . import loop_ir as L
from .lower import Axis, Lowered, Output, Reduction
from .simplify import Ranges, simplify, split_points

# ---- 1. coalescing ---------------------------------------------------------------------------------


def _affines(e: L.Expr, out: list) -> None:
    if isinstance(e, L.Affine):
        out.append(e)
    for c in L.children(e):
        _affines(c, out)


def _exprs(low: Lowered) -> list[L.Expr]:
    return [e for s in low.stores for e in (s.index, s.value)] + [r.body for r in low.reductions]


def coalesce(low: Lowered) -> Lowered:
    """Merge adjacent axes every access walks contiguously (see the module docstring)."""
    axes = list(low.axes)
    k = len(axes) - 1
    while k > 0:
        a, b = axes[k - 1], axes[k]
        affs: list[L.Affine] = []
        for e in _exprs(low):
            _affines(e, affs)
        ok = a.reduced == b.reduced and all(
            sym.canonical(x.coef(a.var)) == sym.canonical(sym.mul(x.coef(b.var), b.extent)) for x in affs
        )
        if ok:
            merged = Axis(a.var, sym.mul(a.extent, b.extent), a.reduced)

            def fix(e: L.Expr, a=a, b=b) -> L.Expr | None:
                if not isinstance(e, L.Affine) or not (e.coef(a.var) or e.coef(b.var)):
                    return None
                terms = tuple((v, c) for v, c in e.terms if v not in (a.var, b.var))
                terms = tuple(sorted((*terms, (a.var, e.coef(b.var))))) if e.coef(b.var) else terms
                return L.Affine(terms, e.const)

            low = replace(
                low,
                stores=[
                    Output(s.buf, L.substitute(s.index, fix), L.substitute(s.value, fix), s.full)
                    for s in low.stores
                ],
                reductions=[replace(r, body=L.substitute(r.body, fix)) for r in low.reductions],
            )
            axes[k - 1 : k + 1] = [merged]
        k -= 1
    return replace(low, axes=axes)


# ---- 2. loops --------------------------------------------------------------------------------------


class _Scope:
    """A loop body being built: its statements, the names it defines, the locals bound in it."""

    def __init__(self, parent: _Scope | None, defined: set[str]) -> None:
        self.parent = parent
        self.stmts: list = []
        self.defined = set(defined)
        self.lets: dict[L.Expr, L.Ref] = {}

    def chain(self):
        s: _Scope | None = self
        while s is not None:
            yield s
            s = s.parent


class _Builder:
    def __init__(self, low: Lowered, lane_var: str | None = None) -> None:
        self.low, self.early = stage_outputs(low)
        self.ranges = {ax.var: (0, ax.extent) for ax in low.axes}
        self.special: dict[L.Expr, L.Expr] | None = None  # per loop piece: specialized expressions
        self.piece: Ranges = {}
        exprs = [s.value for s in low.stores] + [r.body for r in low.reductions]
        last = low.axes[-1] if low.axes else None
        self.splits = split_points(exprs, last.var, last.extent) if last and lane_var is None else []
        self.n = 0
        self.lane_accs: set[str] = set()
        self.lane_var = lane_var

    def fresh(self, prefix: str = "t") -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def needs(self, e: L.Expr) -> set[str]:
        fv = L.free_vars(e)
        if self.lane_accs & fv:
            fv.add(self.lane_var)  # a per-lane accumulator is read at the lane index
        return fv

    def use(self, e: L.Expr, scope: _Scope) -> L.Expr:
        """Bind ``e`` as specialized to the loop piece being built (see ``nest``)."""
        if self.special is not None:
            hit = self.special.get(e)
            if hit is None:
                hit = self.special[e] = simplify(e, {**self.ranges, **self.piece})
            e = hit
        return self.bind(e, scope)

    def bind(self, e: L.Expr, scope: _Scope) -> L.Expr:
        """``e`` with its computations bound to locals, each at the outermost possible loop."""
        if isinstance(e, (L.Const, L.Affine, L.Ref)):
            return e
        for s in scope.chain():
            if e in s.lets:
                return s.lets[e]
        kids = tuple(self.bind(c, scope) for c in L.children(e))
        e2 = _rebuild(e, kids)
        need = self.needs(e2)
        scopes = list(scope.chain())
        target = scope
        for i, s in enumerate(scopes):  # inner to outer: stop where a needed name is not visible
            visible = set().union(*(t.defined for t in scopes[i:]))
            if need <= visible:
                target = s
            else:
                break
        ref = L.Ref(self.fresh(), e.dtype)
        target.stmts.append(L.Let(ref.name, e2))
        target.lets[e] = ref
        target.defined.add(ref.name)
        return ref

    def loop(
        self, parent: _Scope, var: str, extent: L.Expr, kind: str, fill, start: L.Expr | None = None
    ) -> None:
        child = _Scope(parent, {var})
        fill(child)
        parent.stmts.append(L.Loop(var, extent, child.stmts, kind, start or L.Affine((), 0)))

    def nest(self, parent: _Scope, axes: list[Axis], innermost: str, fill) -> None:
        """Loops over ``axes`` (outer to inner), the innermost of kind ``innermost``."""
        if not axes:
            fill(parent)
            return
        ax, rest = axes[0], axes[1:]
        kind = innermost if not rest else "serial"
        cuts = self.splits if not rest and ax.var == self.low.axes[-1].var else []
        if not cuts:
            self.loop(
                parent, ax.var, L.as_index(ax.extent), kind, lambda s: self.nest(s, rest, innermost, fill)
            )
            return
        bounds = [0, *cuts, ax.extent]
        for lo, hi in itertools.pairwise(bounds):  # one loop per piece where every comparison is decided
            self.piece, self.special = {ax.var: (lo, hi)}, {}
            self.loop(parent, ax.var, L.as_index(hi), kind, fill, start=L.as_index(lo))
        self.piece, self.special = {}, None


def _rebuild(e: L.Expr, kids: tuple) -> L.Expr:
    if isinstance(e, L.Load):
        return L.Load(e.buf, kids[0], e.dtype)
    if isinstance(e, L.Call):
        return L.Call(e.template, kids, e.dtype)
    if isinstance(e, L.Cast):
        return L.Cast(kids[0], e.dtype)
    if isinstance(e, L.Select):
        return L.Select(*kids)
    if isinstance(e, L.Bin):
        return L.Bin(e.op, kids[0], kids[1], e.dtype)
    return e


def _levels(reds: list[Reduction]) -> list[list[Reduction]]:
    """Reductions in passes: each pass holds those whose inputs the earlier passes computed."""
    level: dict[str, int] = {}
    for r in reds:
        level[r.acc] = 1 + max((level[d] for d in r.deps), default=-1)
    return [[r for r in reds if level[r.acc] == n] for n in range(1 + max(level.values(), default=-1))]


def _derive(b: _Builder, scope: _Scope, flat: str, axes: list[Axis], extra: sym.Dim = 1) -> None:
    """Bind each axis variable from the flattened index ``flat`` (row-major, ``extra`` innermost)."""
    stride: sym.Dim = extra
    for ax in reversed(axes):
        e: L.Expr = L.floordiv(L.var(flat), L.as_index(stride)) if stride != 1 else L.var(flat)
        if ax is not axes[0]:
            e = L.mod(e, L.as_index(ax.extent))
        scope.stmts.append(L.Let(ax.var, e))
        scope.defined.add(ax.var)
        stride = sym.mul(stride, ax.extent)


def _work(low: Lowered) -> L.Expr:
    return L.as_index(sym.product(ax.extent for ax in low.axes))


def strategies(low: Lowered) -> list[tuple[str, int]]:
    """The schedules worth trying for a (coalesced) group: (strategy, tile)."""
    if any(a.reduced for a in low.axes) and not low.axes[-1].reduced:
        return [("rows", 0), ("cols", 16), ("cols", 64)]
    return [("rows", 0)]


def _simplified(low: Lowered) -> Lowered:
    ranges = {ax.var: (0, ax.extent) for ax in low.axes}
    return replace(
        low,
        stores=[
            Output(o.buf, simplify(o.index, ranges), simplify(o.value, ranges), o.full) for o in low.stores
        ],
        reductions=[replace(r, body=simplify(r.body, ranges)) for r in low.reductions],
    )


def _picks(low: Lowered) -> Lowered:
    """A sum over the one reduced axis ``i`` of ``x * (t == i)``, ``t`` not depending on ``i`` (cross
    entropy's one-hot pick), as ``x`` at ``i = t`` (0 if out of range): a load instead of a pass over
    the row, as the op's reference kernel picks (a NaN or inf elsewhere in the row stays there)."""
    red, sub, keep = [a for a in low.axes if a.reduced], {}, []
    i = red[0].var if len(red) == 1 else ""  # (no var is named "": nothing picks then)
    call = lambda e, tpl: e.args if isinstance(e, L.Call) and e.template == tpl else ()
    for r in low.reductions:
        pick = None
        for x, h in itertools.permutations(call(r.body, "({0}*{1})") if r.reducer == "sum" else (), 2):
            for t, v in itertools.permutations(call((*call(h, "(({ctype}){0})"), None)[0], "({0}=={1})"), 2):
                pick = (x, t, h.args[0]) if v == L.var(i) and i not in L.free_vars(t) else pick
        if pick and all(r.acc not in o.deps for o in low.reductions):
            (x, t, eq), c = pick, L.clamp(pick[1], red[0].extent)
            ok = L.Call(eq.template, (t, c), eq.dtype)
            sub[L.Ref(r.acc, r.dtype)] = L.Select(ok, _put(x, i, c), L.Const(0, r.dtype))
        else:
            keep.append(r)
    fix = lambda e: L.substitute(e, sub.get)
    stores = [Output(o.buf, o.index, fix(o.value), o.full) for o in low.stores]
    return replace(low, stores=stores, reductions=[replace(r, body=fix(r.body)) for r in keep])


def build(low: Lowered, name: str, strategy: str = "rows", tile: int = 0) -> L.Kernel:
    """The loop-IR kernel of ``low`` (coalesced first) under a strategy (see the module docstring)."""
    low = _simplified(coalesce(_simplified(_picks(low))))  # clamps that cannot bind would block merging
    if strategy == "cols":
        body = _build_cols(low, tile)
    else:
        body = _build_rows(low)
    params = [L.Param(i.buf, "in", i.dtype, i.shape) for i in low.inputs]
    params += [L.Param(buf, "out", dt, shape) for buf, dt, shape in low.outputs]
    params += [L.Param(s, "size", L.I64) for s in low.sizes]
    k = L.Kernel(name, params, body, low.label, f"{strategy}{tile or ''}")
    k.work = _work(low)  # type: ignore[attr-defined]
    # an epilogue writing over the matmul product it reads: those two pointers alias
    k.aliased = {low.inputs[-1].buf, low.outputs[low.inplace][0]} if low.inplace is not None else set()  # type: ignore[attr-defined]
    k.body = merge_pieces(k.body)
    mark_streams(k)
    return k


MIN_STREAM_RUN = 256  # bytes: a loop of fewer iterations (a piece of a concat) never streams


def mark_streams(k: L.Kernel) -> None:
    """Mark the stores of outputs written once and never read back (not an output staged as a row
    buffer, not one aliasing an input) whose every store walks its vector loop contiguously, for
    at least ``MIN_STREAM_RUN`` bytes where the loop's length is known: those
    may bypass the caches (``codegen_c`` does when the output is large). Such a loop inside a
    parallel loop over rows also prefetches the next row of the inputs it reads contiguously: the
    row's first pass then finds them in L2, and memory keeps streaming while outputs go out."""
    loads: set[str] = set()
    for s in L.walk_stmts(k.body):
        for e in _stmt_exprs(s):
            _loaded(e, loads)
    stores: dict[str, list[tuple[L.Store, bool]]] = {}
    rows: list[tuple[L.Loop, str | None]] = []  # vector loops with their enclosing parallel loop's var
    dtypes = {p.name: p.dtype for p in k.params}

    def walk(body: list, row: str | None) -> None:
        for loop in body:
            if not isinstance(loop, L.Loop):
                if isinstance(loop, L.Store):  # outside any loop
                    stores.setdefault(loop.buf, []).append((loop, False))
                continue
            vector = loop.kind in ("vector", "parallel_vector")
            inner = {s.name for s in loop.body if isinstance(s, (L.Let, L.Decl))}
            plain = vector and not any(isinstance(s, (L.Accum, L.Loop)) for s in loop.body)
            bufs = [s.buf for s in loop.body if isinstance(s, L.Store)]  # one store per buffer streams
            trip = L.add(loop.extent, L.mul(loop.start, -1))
            short = isinstance(trip, L.Affine) and trip.is_const and isinstance(trip.const, int)
            for s in loop.body:
                if isinstance(s, L.Store):
                    ix = s.index
                    few = short and trip.const * dtypes[s.buf].itemsize < MIN_STREAM_RUN  # type: ignore[union-attr]
                    ok = plain and not few and bufs.count(s.buf) == 1 and isinstance(ix, L.Affine)
                    ok = ok and ix.coef(loop.var) == 1
                    ok = ok and not any(v in inner for v, _ in ix.terms)  # type: ignore[union-attr]
                    stores.setdefault(s.buf, []).append((s, ok))
            if plain:
                rows.append((loop, row))
            walk(
                [s for s in loop.body if isinstance(s, L.Loop)], loop.var if loop.kind == "parallel" else row
            )

    walk(k.body, None)
    outputs = {p.name for p in k.params if p.kind == "out"}
    for buf, found in stores.items():
        if buf not in loads and buf not in k.aliased and all(ok for _, ok in found):  # type: ignore[attr-defined]
            for s, _ in found:
                s.stream = True
    for loop, row in rows:
        if row is None or not any(isinstance(s, L.Store) and s.stream for s in loop.body):
            continue
        ahead: dict[L.Load, None] = {}
        for s in loop.body:
            for e in _stmt_exprs(s):
                for ld in _load_nodes(e):
                    ix = ld.index
                    contiguous = isinstance(ix, L.Affine) and ix.coef(loop.var) == 1
                    if ld.buf not in outputs and contiguous and ix.coef(row):  # type: ignore[union-attr]
                        ahead[L.Load(ld.buf, L.add(ix, L.as_index(ix.coef(row))), ld.dtype)] = None  # type: ignore[union-attr]
        loop.prefetch = list(ahead)


def _stmt_exprs(s) -> list[L.Expr]:
    if isinstance(s, L.Loop):
        return [s.start, s.extent]
    if isinstance(s, L.Let):
        return [s.value]
    if isinstance(s, L.Accum):
        return [s.value]
    if isinstance(s, L.Store):
        return [s.index, s.value]
    return []


def _loaded(e: L.Expr, out: set[str]) -> None:
    out.update(ld.buf for ld in _load_nodes(e))


def _load_nodes(e: L.Expr) -> list[L.Load]:
    found = [e] if isinstance(e, L.Load) else []
    for c in L.children(e):
        found += _load_nodes(c)
    return found


_EXPENSIVE = ("exp(", "log(", "pow(", "tanh(", "erf(", "sin(", "cos(")


def _subexprs(e: L.Expr, out: dict) -> int:
    """Every node under ``e`` with its size (node count); returns e's size."""
    if e in out:
        return out[e]
    n = 1 + sum(_subexprs(c, out) for c in L.children(e))
    out[e] = n
    return n


def _costly(e: L.Expr) -> bool:
    return (isinstance(e, L.Call) and any(f in e.template for f in _EXPENSIVE)) or any(
        _costly(c) for c in L.children(e)
    )


def stage_outputs(low: Lowered) -> tuple[Lowered, dict[int, list[Output]]]:
    """Output buffers as row buffers: when a per-element output needs a costly value a reduction
    pass already computes (softmax's ``exp(x - max)``), that pass stores the value into the output
    and the last pass reads it back (from L1) instead of computing it again."""
    levels = _levels(low.reductions)
    seen = []
    for group in levels:
        nodes: dict = {}
        for r in group:
            _subexprs(r.body, nodes)
        seen.append(nodes)
    early: dict[int, list[Output]] = {}
    stores = []
    for o in low.stores:
        sizes: dict = {}
        if o.full:
            _subexprs(o.value, sizes)
        found = None
        for node in sorted(sizes, key=lambda n: -sizes[n]):
            if node.dtype != o.value.dtype or not _costly(node):
                continue
            level = next((n for n, nodes in enumerate(seen) if node in nodes), None)
            if level is not None:
                found = (node, level)
                break
        if found is None:
            stores.append(o)
            continue
        node, level = found
        early.setdefault(level, []).append(Output(o.buf, o.index, node, True))
        back = L.Load(o.buf, o.index, node.dtype)
        stores.append(
            Output(
                o.buf, o.index, L.substitute(o.value, lambda e, n=node, b=back: b if e == n else None), True
            )
        )
    return replace(low, stores=stores), early


def _passes(b: _Builder, row: _Scope, red_axes: list[Axis], lanes: tuple | None = None) -> None:
    """Each pass over the reduced axes, then the per-element stores."""
    low, early = b.low, b.early
    for level, group in enumerate(_levels(low.reductions)):
        for r in group:
            row.stmts.append(L.Decl(r.acc, r.dtype, r.reducer, lanes[1] if lanes else 0))

        def body(s: _Scope, group=group, level=level) -> None:
            for r in group:
                s.stmts.append(L.Accum(r.acc, r.reducer, b.use(r.body, s), lanes[0] if lanes else None))
            for o in early.get(level, ()):
                s.stmts.append(L.Store(o.buf, o.index, b.use(o.value, s)))

        if lanes:
            b.nest(row, red_axes, "serial", lambda s, body=body: _lane_loop(b, s, lanes, body))
        else:
            b.nest(row, red_axes, "vector", body)
        for r in group:
            if r.reducer in ("max", "min") and r.dtype.kind == "f":
                row.stmts.append(L.Finish(r.acc, r.reducer, lanes[1] if lanes else 0))
            row.defined.add(r.acc)
            if lanes:
                b.lane_accs.add(r.acc)
    full = [s for s in low.stores if s.full]
    if full:

        def stores(s: _Scope) -> None:
            for o in full:
                s.stmts.append(L.Store(o.buf, o.index, b.use(o.value, s)))

        if lanes:
            b.nest(row, red_axes, "serial", lambda s: _lane_loop(b, s, lanes, stores))
        else:
            b.nest(row, red_axes, "vector", stores)


def _build_rows(low: Lowered) -> list:
    b = _Builder(low)
    root = _Scope(None, set(low.sizes))
    kept = [a for a in low.axes if not a.reduced]
    red = [a for a in low.axes if a.reduced]
    if not red:  # elementwise: the last axis is the vector loop
        outer, inner = kept[:-1], kept[-1:]
    else:
        outer, inner = kept, red

    def row_body(row: _Scope) -> None:
        if red:
            _passes(b, row, inner)
        else:
            full = low.stores

            def stores(s: _Scope) -> None:
                for o in full:
                    s.stmts.append(L.Store(o.buf, o.index, b.use(o.value, s)))

            b.nest(row, inner, "vector", stores)
        for o in low.stores:
            if not o.full:
                row.stmts.append(L.Store(o.buf, o.index, b.use(o.value, row)))

    if not outer and not red and len(inner) == 1:  # one flat elementwise loop: threads and SIMD
        ax = inner[0]

        def flat(s: _Scope) -> None:
            for o in low.stores:
                s.stmts.append(L.Store(o.buf, o.index, b.use(o.value, s)))

        b.loop(root, ax.var, L.as_index(ax.extent), "parallel_vector", flat)
    elif not outer:
        row_body(root)
    elif len(outer) == 1:
        b.loop(root, outer[0].var, L.as_index(outer[0].extent), "parallel", row_body)
    else:

        def flat_rows(s: _Scope) -> None:
            _derive(b, s, "o", outer)
            row_body(s)

        b.loop(root, "o", L.as_index(sym.product(a.extent for a in outer)), "parallel", flat_rows)
    return root.stmts


def _lane_loop(b: _Builder, s: _Scope, lanes: tuple, fill) -> None:
    lane, _, col, k0, n = lanes

    def body(t: _Scope) -> None:
        t.stmts.append(L.Let(col.var, L.add(L.Ref(k0, L.I64), L.var(lane))))
        t.defined.add(col.var)
        fill(t)

    b.loop(s, lane, L.Ref(n, L.I64), "vector", body)


def _build_cols(low: Lowered, tile: int) -> list:
    lane = "j"
    b = _Builder(low, lane)
    root = _Scope(None, set(low.sizes))
    col = low.axes[-1]
    others = [a for a in low.axes[:-1] if not a.reduced]
    red = [a for a in low.axes if a.reduced]
    ntiles_e = L.floordiv(L.as_index(sym.add(col.extent, tile - 1)), L.as_index(tile))

    def tile_body(s: _Scope) -> None:
        s.stmts.append(L.Let("tt", L.mod(L.var("o"), ntiles_e)))
        s.defined.add("tt")
        if others:
            rest = L.floordiv(L.var("o"), ntiles_e)
            s.stmts.append(L.Let("orow", rest))
            s.defined.add("orow")
            _derive(b, s, "orow", others)
        s.stmts.append(L.Let("k0", L.mul(L.var("tt"), tile)))
        s.stmts.append(
            L.Let("nl", L.Bin("min", L.as_index(tile), L.add(L.as_index(col.extent), L.mul(L.var("k0"), -1))))
        )
        s.defined |= {"k0", "nl"}
        lanes = (lane, tile, col, "k0", "nl")
        _passes(b, s, red, lanes)
        outer = [o for o in low.stores if not o.full]
        if outer:

            def stores(t: _Scope) -> None:
                for o in outer:
                    t.stmts.append(L.Store(o.buf, o.index, b.use(o.value, t)))

            _lane_loop(b, s, lanes, stores)

    count = L.mul(L.as_index(sym.product(a.extent for a in others)), ntiles_e) if others else ntiles_e
    b.loop(root, "o", count, "parallel", tile_body)
    return root.stmts


def merge_pieces(body: list) -> list:
    """Adjacent vector loops as long as each other (the pieces of a split concat) as one loop, the
    later ones shifted onto the first's range, so values they share are computed once (SwiGLU's
    backward: the gate's sigmoid). Only loops of lets and stores that read no buffer they write,
    of 64 iterations or more (shorter ones measured as fast apart: rotary's halves)."""
    out: list = []
    for s in body:
        if isinstance(s, L.Loop):
            s.body, prev = merge_pieces(s.body), out[-1] if out and isinstance(out[-1], L.Loop) else None
            trip = L.add(s.extent, L.mul(s.start, -1))
            if prev and {prev.kind, s.kind} == {"vector"} and prev.var == s.var:
                stmts = prev.body + s.body
                loads = {ld.buf for x in stmts for e in _stmt_exprs(x) for ld in _load_nodes(e)}
                shift = L.add(s.start, L.mul(prev.start, -1))
                plain = all(isinstance(x, (L.Let, L.Store)) for x in stmts)
                plain = plain and not loads & {x.buf for x in stmts if isinstance(x, L.Store)}
                short = isinstance(getattr(trip, "const", None), int) and trip.const < 64
                if (
                    plain
                    and not short
                    and shift.is_const
                    and trip == L.add(prev.extent, L.mul(prev.start, -1))
                ):
                    _shift_into(prev, s, shift.const)
                    continue
        out.append(s)
    return out


def _shift_into(dst: L.Loop, src: L.Loop, shift: sym.Dim) -> None:
    """Append ``src``'s body to ``dst``'s with its variable shifted by ``shift``, reusing dst's lets."""
    seen = {x.value: L.Ref(x.name, x.value.dtype) for x in dst.body if isinstance(x, L.Let)}
    names: dict[str, L.Expr] = {}

    ren = lambda y: names.get(y.name) if isinstance(y, L.Ref) else None
    at = L.add(L.var(src.var), L.as_index(shift))
    for x in src.body:
        fix = [L.substitute(_put(_put(e, src.var, L.var("~")), "~", at), ren) for e in _stmt_exprs(x)]
        if isinstance(x, L.Store):
            dst.body.append(L.Store(x.buf, *fix))
        elif fix[0] in seen:
            names[x.name] = seen[fix[0]]
        else:
            dst.body.append(L.Let(x.name, fix[0]))
            seen[fix[0]] = L.Ref(x.name, fix[0].dtype)


def _put(e: L.Expr, i: str, value: L.Expr) -> L.Expr:
    """``e`` with the loop variable ``i`` replaced by ``value`` (in which ``i`` does not occur)."""

    def fn(x: L.Expr) -> L.Expr | None:
        if not isinstance(x, L.Affine) or not x.coef(i):
            return None
        return L.add(L.Affine(tuple(v for v in x.terms if v[0] != i), x.const), L.mul(value, x.coef(i)))

    return L.substitute(e, fn)
