"""Parsing the pieces of the PIR text form: tokens, types, dims and attributes.

:class:`TextParser` holds the token cursor and the error reporting (line:column plus the source
line); :mod:`.parser` builds programs on top of it, and the PassManager reads pass options with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from .. import backend as B
from .. import symbolic as sym
from ..types import DTYPE_BY_SHORT, ScalarType, TensorType, Type, check_dim
from .attributes import (
    ArrayAttr,
    Attribute,
    BoolAttr,
    DenseAttr,
    DictAttr,
    DimAttr,
    DTypeAttr,
    FloatAttr,
    IntAttr,
    NoneAttr,
    ShapeAttr,
    StrAttr,
    opaque_attr,
)
from .lexer import EOF_KIND, Tokens, describe, unquote

MAX_DEPTH = 64  # nesting of regions and attributes
_KEYWORD_ATTRS = {
    "true": BoolAttr(True),
    "false": BoolAttr(False),
    "none": NoneAttr(),
    "inf": FloatAttr(float("inf")),
    "nan": FloatAttr(float("nan")),
}
_DIM_TOKENS = frozenset({"int", "ident"})
_DIM_PUNCT = frozenset({"+", "-", "*", "(", ")"})


class TextParser:
    """A cursor over the tokens of one text, with parsers for types and attributes."""

    def __init__(self, text: str) -> None:
        self.toks = Tokens(text)
        self.resources: dict[str, DenseAttr] = {}
        self.depth = 0
        self._dims: dict[str, Any] = {}  # dim text -> canonical dim (programs repeat their dims)
        self.window(0, len(self.toks.kinds) - 1)

    def window(self, start: int, stop: int) -> None:
        """Parse tokens ``[start, stop)`` next; end-of-input tokens pad the end, so lookahead
        needs no bounds checks. Positions in errors stay those of the whole text."""
        t, pad = self.toks, 4
        self.kinds = t.kinds[start:stop] + [EOF_KIND] * pad
        self.texts = t.texts[start:stop] + [""] * pad
        self.offsets = t.offsets[start:stop] + [t.offsets[stop]] * pad
        self.i = 0

    def fail(self, reason: str, at: int | None = None) -> NoReturn:
        self.toks.fail(reason, self.offsets[self.i if at is None else at])
        raise AssertionError  # unreachable: fail raises

    def peek(self, k: int = 0) -> str:
        """The text of the token ``k`` ahead ("" at the end; a string token keeps its quotes,
        so it never equals punctuation or a keyword)."""
        return self.texts[self.i + k]

    def kind(self, k: int = 0) -> str:
        return self.kinds[self.i + k]

    def got(self) -> str:
        return describe(self.kind(), self.peek())

    def expect(self, text: str, what: str = "") -> int:
        if self.texts[self.i] != text:
            self.fail(f"expected {text!r}{' ' + what if what else ''}, got {self.got()}")
        self.i += 1
        return self.i - 1

    def accept(self, text: str) -> bool:
        if self.texts[self.i] == text:
            self.i += 1
            return True
        return False

    def take(self, kind: str, what: str) -> str:
        if self.kind() != kind:
            self.fail(f"expected {what}, got {self.got()}")
        self.i += 1
        return self.texts[self.i - 1]

    def items(self, close: str, item: Callable[[], Any], between: str) -> list[Any]:
        """``item()``s separated by ',' up to ``close`` (taken); ``between``: what a ',' is
        expected before, for the error."""
        out: list[Any] = []
        while not self.accept(close):
            if out:
                self.expect(",", between)
            out.append(item())
        return out

    def comma_list(self, item: Callable[[], Any]) -> list[Any]:
        """``item()``, then one more after each ','."""
        out = [item()]
        while self.accept(","):
            out.append(item())
        return out

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail(f"nesting deeper than {MAX_DEPTH} levels")

    # ---- program ------------------------------------------------------------------------------
    def type(self) -> Type:
        at = self.i
        name = self.take("ident", "a type like f32[2, S]")
        dt = DTYPE_BY_SHORT.get(name)
        if dt is None:
            self.fail(f"unknown dtype {name!r} (expected one of {', '.join(DTYPE_BY_SHORT)})", at)
        dt = B.dtype(dt)
        if self.texts[self.i] != "[":
            return ScalarType(dt)
        self.i += 1
        dims = self.items("]", lambda: (self.i, self.dim_expr()), "or ']' after a dim")
        try:
            return TensorType(tuple(d for _, d in dims), dt)  # interned: a known type skips validation
        except TypeError:
            for d_at, d in dims:
                try:
                    check_dim(d)
                except TypeError as e:
                    self.fail(f"bad dim: {e}", d_at)
            raise

    def dim_expr(self) -> Any:
        """A dim: an int or a symbolic expression (canonicalized)."""
        at, parts, depth = self.i, [], 0
        while True:
            k, t = self.kind(), self.peek()
            if k in _DIM_TOKENS or (k == "punct" and t in _DIM_PUNCT):
                if t == "(":
                    depth += 1
                elif t == ")":
                    if depth == 0:
                        break
                    depth -= 1
                parts.append(t)
                self.i += 1
            else:
                break
        if not parts:
            self.fail(f"expected a dim (an int or a symbol like S), got {self.got()}")
        text = "".join(parts)
        d = self._dims.get(text)
        if d is None:
            try:
                d = int(text) if len(parts) == 1 and text.isdigit() else sym.canonical(text)
            except (sym.DimError, ValueError) as e:
                self.fail(f"bad dim {text!r}: {e}", at)
            self._dims[text] = d
        return d

    # ---- attributes ---------------------------------------------------------------------------
    def attr_dict(self) -> dict[str, Attribute]:
        return self.attr_dict_with_positions()[0]

    def attr_dict_with_positions(self) -> tuple[dict[str, Attribute], dict[str, tuple[int, int]]]:
        """The attributes and, for each, the token index of its name and of its value."""
        self.nest()
        self.expect("{", "to open an attribute dictionary")
        out: dict[str, Attribute] = {}
        where: dict[str, tuple[int, int]] = {}
        while not self.accept("}"):
            if out:
                self.expect(",", "or '}' after an attribute")
            at = self.i
            if self.kind() == "string":
                key = self._unquote(self.texts[self.i])
                self.i += 1
            else:
                key = self.take("ident", "an attribute name")
            if key in out:
                self.fail(f"attribute {key!r} is given twice", at)
            self.expect("=", f"after attribute name {key!r}")
            where[key] = (at, self.i)
            out[key] = self.attr()
        self.depth -= 1
        return out, where

    def _unquote(self, tok: str) -> str:
        try:
            return unquote(tok)
        except ValueError as e:
            self.fail(str(e))

    def attr(self) -> Attribute:
        k, t = self.kind(), self.peek()
        if k == "string":
            self.i += 1
            return StrAttr(self._unquote(t))
        if k == "float":
            self.i += 1
            return FloatAttr(float(t))
        if k == "punct":
            if t == "[":
                return self.array()
            if t == "{":
                return DictAttr(self.attr_dict())
            if t == "-" and self.kind(1) == "float":
                self.i += 2
                return FloatAttr(-float(self.texts[self.i - 1]))
            if t == "-" and self.peek(1) == "inf" and self.kind(1) == "ident":
                self.i += 2
                return FloatAttr(float("-inf"))
        if k == "hash":
            return self.opaque()
        if k == "ident":
            if t in _KEYWORD_ATTRS:
                self.i += 1
                return _KEYWORD_ATTRS[t]
            if t in DTYPE_BY_SHORT:
                self.i += 1
                return DTypeAttr(B.dtype(DTYPE_BY_SHORT[t]))
            if t == "dense":
                return self.dense()
            if t == "dense_resource":
                return self.dense_resource()
        if k in _DIM_TOKENS or (k == "punct" and t in ("-", "(")):
            at = self.i
            d = self.dim_expr()
            if isinstance(d, int):
                return IntAttr(d)
            try:
                return DimAttr(d)
            except TypeError as e:
                self.fail(f"bad dim: {e}", at)
        self.fail(f"expected an attribute value, got {self.got()}")

    def array(self) -> Attribute:
        self.nest()
        self.expect("[")
        items = self.items("]", self.attr, "or ']' in a list")
        self.depth -= 1
        if all(type(a) is IntAttr or type(a) is DimAttr for a in items):
            return ShapeAttr(a.value for a in items)
        return ArrayAttr(items)

    def opaque(self) -> Attribute:
        kind = self.take("hash", "an attribute like #shard<0>")[1:]
        self.nest()
        self.expect("<", f"after #{kind}")
        params = self.items(">", self.attr, "or '>' in an attribute's parameters")
        self.depth -= 1
        try:
            return opaque_attr(kind, params)
        except (ValueError, TypeError) as e:
            self.fail(f"bad #{kind} attribute: {e}")

    def dense_resource(self) -> Attribute:
        self.i += 1
        self.expect("<", "after dense_resource")
        at = self.i
        name = self.take("ident", "a resource name")
        self.expect(">", "after the resource name")
        a = self.resources.get(name)
        if a is None:
            self.fail(f"undefined resource {name!r} (no such entry in the resources section)", at)
        return a

    def dense(self) -> DenseAttr:
        self.i += 1
        self.expect("<", "after dense")
        at = self.i
        t = self.type()
        if not isinstance(t, TensorType) or not t.is_static:
            self.fail("a dense constant needs a static tensor type like f32[2, 3]", at)
        shape, dt = t.shape, t.dtype
        n = math.prod(shape)
        if n > 1 << 31:
            self.fail(f"a constant of {n} elements is too large", at)
        if self.kind() == "hex":
            at = self.i
            raw = self.texts[self.i][2:]
            self.i += 1
            if len(raw) != 2 * n * dt.itemsize:
                self.fail(f"{t} needs {n * dt.itemsize} bytes, the hex gives {len(raw) // 2}", at)
            arr = np.frombuffer(bytes.fromhex(raw), dtype=dt).reshape(shape)
        else:
            at = self.i
            self.expect("[", "or hex data after the constant's type")
            vals = self.items("]", lambda: self.element(dt), "or ']' between elements")
            if len(vals) != n:
                self.fail(f"{t} needs {n} elements, got {len(vals)}", at)
            try:
                arr = np.array(vals, dtype=dt).reshape(shape)
            except (ValueError, OverflowError, TypeError) as e:
                self.fail(f"elements do not fit {t}: {e}", at)
        self.expect(">", "to close the constant")
        return DenseAttr(arr)

    def element(self, dt: np.dtype) -> Any:
        at = self.i
        neg = self.accept("-")
        k, t = self.kind(), self.peek()
        self.i += 1
        if k == "int":
            v: Any = -int(t) if neg else int(t)
            if dt.kind in "iu" and not np.iinfo(dt).min <= v <= np.iinfo(dt).max:
                self.fail(f"{v} does not fit {dt}", at)
            return v
        if k in ("float", "ident") and (k == "float" or t in ("inf", "nan")) and dt in B.FLOAT_DTYPES:
            return -float(t) if neg else float(t)
        if k == "ident" and t in ("true", "false") and not neg and dt.kind == "b":
            return t == "true"
        self.fail(f"expected an element of a {dt} constant, got {describe(k, t)}", at)
