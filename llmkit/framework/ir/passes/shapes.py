"""``simplify-shapes``: symbolic shape simplification.

1. Substitute symbols (option ``bind = {B = 2, T = S}``: a symbol -> an int or another dim) in
   function input types, attributes and result types, then re-infer every result type with the
   ops' ``infer_meta`` so the substitution reaches every value (``B*S`` becomes ``2*S``...).
2. Make implicit sizes explicit: the ``-1`` of a ``shape`` attribute (trait ``shape_attr``:
   ``reshape``, ``expand``) becomes the dim it stands for.
3. Fold shape-only ops (trait ``shape_only``): ``numel`` over static dims becomes a constant.

Dims are kept canonical throughout (``symbolic.canonical``), so equal sizes print equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import symbolic as sym
from ...opspec import OpError, Trait
from ...symbolic import Dim
from ...types import TensorType, Type
from ..attributes import Attribute, DimAttr, ShapeAttr, dim_attr
from ..builder import Builder
from ..core import Operation
from ..errors import IRError
from ..pass_manager import Pass, register_pass
from ..program import Program


def substitute(d: Dim, mapping: Mapping[str, Dim]) -> Dim:
    """``d`` with each symbol replaced by its dim in ``mapping`` (others kept)."""
    if isinstance(d, int) or not mapping:
        return d
    total: Dim = 0
    for mono, c in sym.poly(d).items():
        term: Dim = c
        for s in mono:
            term = sym.mul(term, mapping.get(s, s))
        total = sym.add(total, term)
    return sym.canonical(total)


def _sub_type(t: Type, mapping: Mapping[str, Dim]) -> Type:
    if isinstance(t, TensorType) and not t.is_static:
        return TensorType([substitute(d, mapping) for d in t.shape], t.dtype)
    return t


def _sub_attr(a: Attribute, mapping: Mapping[str, Dim]) -> Attribute:
    if type(a) is DimAttr:
        return dim_attr(substitute(a.value, mapping))
    if type(a) is ShapeAttr and a.symbolic:
        return ShapeAttr([substitute(d, mapping) for d in a.value])
    return a


def _explicit_sizes(op: Operation) -> None:
    """An op whose ``shape`` attribute is its result's shape (trait ``shape_attr``: reshape,
    expand): write the dims its -1 entries stand for."""
    if Trait.SHAPE_ATTR not in op.opdef.traits:
        return
    shape = op.attributes["shape"].value
    if -1 in shape:
        out = op.results[0].type.shape
        op.set_attr("shape", ShapeAttr([o if s == -1 else s for s, o in zip(shape, out, strict=False)]))


def _fold_shape_only(op: Operation) -> bool:
    """An op whose result depends on its operands' shapes alone (trait ``shape_only``: numel)
    becomes a constant where its ``splat`` rule knows the value (the dims it reads are static)."""
    if Trait.SHAPE_ONLY not in op.opdef.traits or any(a.symbolic for a in op.attributes.values()):
        return False
    try:
        value = op.opdef.spec.splat(*op._operands, **op.plain_attrs)
    except OpError:  # the op rejects its operands: left for the run to report
        return False
    t = op.results[0].type
    if value is None or not t.is_static:
        return False
    array = np.full(t.shape, value, t.dtype)
    c = Builder.before_op(op).create("builtin.constant", (), {"value": array}, names=[op.results[0].name])
    op.results[0].replace_all_uses_with(c.results[0])
    op.erase()
    return True


@register_pass
@dataclass
class SimplifyShapes(Pass):
    name = "simplify-shapes"
    bind: dict[str, Any] = field(default_factory=dict)  # symbol -> int or dim expression

    def apply(self, program: Program) -> None:
        mapping: dict[str, Dim] = {}
        for k, v in self.bind.items():
            try:
                mapping[k] = sym.canonical(v) if isinstance(v, str) else int(v)
            except (sym.DimError, TypeError, ValueError):
                raise IRError(f"simplify-shapes: bind[{k!r}] = {v!r} is not a dim") from None
        for f in program.functions.values():
            for a in f.args:
                a.type = _sub_type(a.type, mapping)
            for op in list(f.walk()):
                if op.parent is None:
                    continue
                self._op(op, mapping)

    def _op(self, op: Operation, mapping: Mapping[str, Dim]) -> None:
        if mapping:
            for k, a in list(op.attributes.items()):
                new = _sub_attr(a, mapping)
                if new is not a:
                    op.set_attr(k, new)
        d = op.opdef
        if d.infer is not None:
            try:
                types = d.infer(op._operands, op.plain_attrs)
            except Exception as e:
                raise IRError(
                    f"simplify-shapes: {op.name} no longer type-checks after substitution: {e}"
                ) from e
            for r, t in zip(op.results, types, strict=False):
                r.type = t
        elif mapping:
            for r in op.results:
                r.type = _sub_type(r.type, mapping)
        if not _fold_shape_only(op):
            _explicit_sizes(op)
