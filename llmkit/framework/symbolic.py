"""Symbolic dimensions.

A dimension is an ``int`` or a ``str`` naming a symbol or an integer polynomial of symbols
(``"S"``, ``"B*S"``, ``"S+T"``, ``"2*S+1"``). Strings are kept in one canonical form, so two dims
are equal exactly when their strings are; arithmetic returns an ``int`` whenever the result is
constant. Programs traced with symbolic dims serve every size the symbols can take.
"""

from __future__ import annotations

import re
from functools import lru_cache, reduce
from math import prod

Dim = int | str
# A polynomial: monomial (sorted tuple of symbol names, with repeats) -> integer coefficient.
Poly = dict[tuple[str, ...], int]

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z_0-9]*)|(//|[-+*()]))")


class DimError(ValueError):
    """A symbolic dimension expression that cannot be parsed or evaluated."""


@lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[tuple[tuple[str, ...], int], ...]:
    toks: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise DimError(f"bad symbolic dim {text!r} at column {pos + 1}")
        num, name, op = m.groups()
        toks.append(("n", num) if num else ("s", name) if name else ("o", op))
        pos = m.end()
    i = 0

    def peek() -> tuple[str, str] | None:
        return toks[i] if i < len(toks) else None

    def take() -> tuple[str, str]:
        nonlocal i
        if i >= len(toks):
            raise DimError(f"bad symbolic dim {text!r}: unexpected end")
        i += 1
        return toks[i - 1]

    def atom() -> Poly:
        kind, v = take()
        if kind == "n":
            return {(): int(v)}
        if kind == "s":
            return {(v,): 1}
        if v == "(":
            p = expr()
            if take() != ("o", ")"):
                raise DimError(f"bad symbolic dim {text!r}: expected ')'")
            return p
        if v == "-":
            return _scale(atom(), -1)
        raise DimError(f"bad symbolic dim {text!r}: unexpected {v!r}")

    def term() -> Poly:
        p = atom()
        while peek() in (("o", "*"), ("o", "//")):
            op = take()[1]
            q = atom()
            p = _mul(p, q) if op == "*" else _div(p, q, text)
        return p

    def expr() -> Poly:
        p = term()
        while peek() in (("o", "+"), ("o", "-")):
            op = take()[1]
            q = term()
            p = _add(p, q if op == "+" else _scale(q, -1))
        return p

    p = expr()
    if i != len(toks):
        raise DimError(f"bad symbolic dim {text!r}: trailing {toks[i][1]!r}")
    return tuple(sorted(p.items()))


def _clean(p: Poly) -> Poly:
    return {k: v for k, v in p.items() if v != 0}


def _add(a: Poly, b: Poly) -> Poly:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return _clean(out)


def _scale(a: Poly, c: int) -> Poly:
    return _clean({k: v * c for k, v in a.items()})


def _mul(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for ka, va in a.items():
        for kb, vb in b.items():
            k = tuple(sorted(ka + kb))
            out[k] = out.get(k, 0) + va * vb
    return _clean(out)


def _div(a: Poly, b: Poly, text: str = "") -> Poly:
    """Exact division by a single monomial; anything else is not a dimension."""
    if len(b) != 1:
        raise DimError(f"cannot divide {_fmt(a)} by {_fmt(b)} exactly{f' in {text!r}' if text else ''}")
    ((kb, vb),) = b.items()
    out: Poly = {}
    for ka, va in a.items():
        rest = list(ka)
        for s in kb:
            if s not in rest:
                raise DimError(f"cannot divide {_fmt(a)} by {_fmt(b)} exactly")
            rest.remove(s)
        if va % vb:
            raise DimError(f"cannot divide {_fmt(a)} by {_fmt(b)} exactly")
        out[tuple(rest)] = va // vb
    return out


def _fmt(p: Poly) -> Dim:
    if not p:
        return 0
    if set(p) == {()}:
        return p[()]
    parts = []
    # Highest degree first, then by name; the constant last.
    for mono, c in sorted(p.items(), key=lambda kv: (-len(kv[0]), kv[0])):
        body = "*".join(mono)
        if not mono:
            s = str(abs(c))
        elif abs(c) == 1:
            s = body
        else:
            s = f"{abs(c)}*{body}"
        parts.append(("-" if c < 0 else "+", s))
    text = "".join(f"{sign}{s}" for sign, s in parts)
    return text[1:] if text[0] == "+" else text


def poly(d: Dim) -> Poly:
    if isinstance(d, (int,)) and not isinstance(d, bool):
        return {(): int(d)} if d else {}
    if isinstance(d, str):
        return dict(_parse(d))
    raise DimError(f"a dimension must be an int or a symbol string, got {d!r}")


def canonical(d: Dim) -> Dim:
    """The canonical form of a dim: an ``int`` when constant, else the normalized string."""
    return d if isinstance(d, int) else _fmt(poly(d))


def is_static(d: Dim) -> bool:
    return isinstance(d, int)


def add(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    return _fmt(_add(poly(a), poly(b)))


def sub(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a - b
    return _fmt(_add(poly(a), _scale(poly(b), -1)))


def mul(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return _fmt(_mul(poly(a), poly(b)))


def div(a: Dim, b: Dim) -> Dim:
    """Exact division (the quotient of a reshape's ``-1``); raises :class:`DimError` otherwise."""
    if isinstance(a, int) and isinstance(b, int):
        if b == 0 or a % b:
            raise DimError(f"{a} is not divisible by {b}")
        return a // b
    return _fmt(_div(poly(a), poly(b)))


def product(dims) -> Dim:
    return reduce(mul, dims, 1)


def total(dims) -> Dim:
    return reduce(add, dims, 0)


def symbols(d: Dim) -> set[str]:
    return set() if isinstance(d, int) else {s for mono in poly(d) for s in mono}


def evaluate(d: Dim, env: dict[str, int]) -> int:
    """The value of a dim once its symbols are bound."""
    if isinstance(d, int):
        return d
    total = 0
    for mono, c in _parse(d):
        try:
            total += c * prod(env[s] for s in mono)
        except KeyError as e:
            raise DimError(f"symbol {e.args[0]!r} of dim {d!r} is not bound") from None
    return total


def bind(declared: Dim, actual: int, env: dict[str, int]) -> bool:
    """Unify a declared dim with a concrete size, extending ``env``; False on a mismatch.

    A plain symbol binds; an expression must evaluate to ``actual`` once its symbols are bound.
    """
    if isinstance(declared, int):
        return declared == actual
    p = poly(declared)
    if len(p) == 1:
        ((mono, c),) = p.items()
        if len(mono) == 1 and c == 1:
            s = mono[0]
            if s in env:
                return env[s] == actual
            env[s] = actual
            return True
    try:
        return evaluate(declared, env) == actual
    except DimError:
        return True  # decided later, once its symbols are bound


def broadcast(a: Dim, b: Dim) -> Dim | None:
    """The broadcast of two dims, or None when they are incompatible."""
    if a == b:
        return a
    if a == 1:
        return b
    if b == 1:
        return a
    return None
