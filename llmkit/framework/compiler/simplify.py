"""Range facts about loop variables, used to simplify index arithmetic and split loops.

Each loop variable has a range ``[lo, hi)`` (dims). With them an affine index has bounds, so a
clamp that cannot bind disappears (``imax(imin(i, 31), 0)`` with ``i`` in ``[0, 32)`` is ``i``)
and a comparison that cannot change decides its ``Select``. :func:`split_points` finds where
the innermost loop should be cut so that every comparison on it is decided in each piece: a
concat along the last axis (rotary's ``rotate_half``) becomes two contiguous loops instead of
one loop of clamped gathers.
"""

from __future__ import annotations

from .. import symbolic as sym
from . import loop_ir as L

Ranges = dict[str, tuple[sym.Dim, sym.Dim]]


def _le(a: sym.Dim, b: sym.Dim) -> bool:
    """a <= b for every size the symbols can take (only when the difference is a constant)."""
    d = sym.canonical(sym.sub(b, a))
    return isinstance(d, int) and d >= 0


def bounds(e: L.Expr, ranges: Ranges) -> tuple[sym.Dim, sym.Dim] | None:
    """(min, max) of an affine index whose variables all have ranges and integer coefficients."""
    if not isinstance(e, L.Affine):
        return None
    lo = hi = e.const
    for v, c in e.terms:
        if v not in ranges or not isinstance(c, int):
            return None
        a, b = ranges[v][0], sym.sub(ranges[v][1], 1)
        lo, hi = (
            (sym.add(lo, sym.mul(c, a)), sym.add(hi, sym.mul(c, b)))
            if c > 0
            else (
                sym.add(lo, sym.mul(c, b)),
                sym.add(hi, sym.mul(c, a)),
            )
        )
    return lo, hi


def decide(cond: L.Expr, ranges: Ranges) -> bool | None:
    """The value of ``a < b`` or ``a >= b`` if the ranges fix it."""
    if not isinstance(cond, L.Bin) or cond.op not in ("<", ">="):
        return None
    r = bounds(L.add(cond.a, L.mul(cond.b, -1)), ranges)
    if r is None:
        return None
    lt = True if _le(r[1], -1) else False if _le(0, r[0]) else None
    return lt if cond.op == "<" or lt is None else not lt


def simplify(e: L.Expr, ranges: Ranges) -> L.Expr:
    """Drop clamps that cannot bind and decide comparisons the ranges fix."""

    def fn(x: L.Expr) -> L.Expr | None:
        if isinstance(x, L.Bin) and x.op == "max" and isinstance(x.a, L.Bin) and x.a.op == "min":
            r = bounds(x.a.a, ranges)
            lo, hi = x.b, x.a.b
            consts = isinstance(lo, L.Affine) and lo.is_const and isinstance(hi, L.Affine) and hi.is_const
            if r and consts and _le(lo.const, r[0]) and _le(r[1], hi.const):
                return x.a.a
        if isinstance(x, L.Select):
            d = decide(x.cond, ranges)
            if d is not None:
                return x.a if d else x.b
        return None

    return L.substitute(e, fn)


def split_points(exprs: list[L.Expr], var: str, extent: sym.Dim) -> list[int]:
    """Static cut points in ``(0, extent)`` of comparisons ``var + c < k`` found in ``exprs``."""
    if not isinstance(extent, int):
        return []
    points: set[int] = set()
    seen: set[L.Expr] = set()

    def visit(x: L.Expr) -> None:
        if x in seen:
            return
        seen.add(x)
        if isinstance(x, L.Select) and isinstance(x.cond, L.Bin) and x.cond.op in ("<", ">="):
            d = L.add(x.cond.a, L.mul(x.cond.b, -1))  # var + c - k < 0  <=>  var < k - c
            if (
                isinstance(d, L.Affine)
                and d.terms == ((var, 1),)
                and isinstance(d.const, int)
                and 0 < -d.const < extent
            ):
                points.add(-d.const)
        for c in L.children(x):
            visit(c)

    for e in exprs:
        visit(e)
    return sorted(points)
