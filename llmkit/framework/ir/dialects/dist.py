"""``dist``: communication between ranks (shells the auto-parallel issue fills in).

Every op carries a ``mesh`` and (except send/recv) ``placements`` attribute; their values are any
attribute for now (strings, arrays or ``#shard<0>``-style opaque attributes) until the placement
types exist. Result types are explicit (they depend on the mesh), except ``all_reduce``, which
keeps its operand's type. None of these ops is pure: passes never drop or merge communication.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..attributes import IntAttr, StrAttr
from ..core import Value
from ..opdef import Dialect, OpDef, any_attr, is_a
from ..types import Type

REDUCE_OPS = ("sum", "avg", "max", "min")


def _reduce_attr(a: Any) -> str | None:
    if isinstance(a, StrAttr) and a.value in REDUCE_OPS:
        return None
    return f"one of {', '.join(map(repr, REDUCE_OPS))}"


def _same_type(operands: Sequence[Value], attrs: Mapping[str, Any]) -> list[Type]:
    return [operands[0].type]


_PLACED = {"mesh": any_attr, "placements": any_attr}
_EXTRA = {"*": any_attr}


def _op(name: str, doc: str, *, operands: int = 1, results: int | None = 1, attrs=None, **kw: Any) -> OpDef:
    return OpDef(
        f"dist.{name}",
        frozenset(),
        min_operands=operands,
        max_operands=operands,
        num_results=results,
        attrs=attrs if attrs is not None else _PLACED,
        optional_attrs={**_EXTRA, **kw.pop("optional", {})},
        doc=doc,
        **kw,
    )


DIALECT = Dialect(
    "dist",
    [
        _op(
            "all_reduce",
            "Reduce a Partial value over the mesh (reduce: sum|avg|max|min).",
            optional={"reduce": _reduce_attr},
            infer=_same_type,
        ),
        _op("all_gather", "Gather the shards of a Shard(axis) value into a replicated one."),
        _op(
            "reduce_scatter",
            "Reduce a Partial value and leave it sharded.",
            optional={"reduce": _reduce_attr},
        ),
        _op("all_to_all", "Move the sharded axis: split one axis, concatenate another."),
        _op(
            "send",
            "Send a value to rank `peer` (pipeline stages).",
            results=0,
            attrs={"mesh": any_attr, "peer": is_a(IntAttr)},
        ),
        _op(
            "recv",
            "Receive a value from rank `peer`.",
            operands=0,
            attrs={"mesh": any_attr, "peer": is_a(IntAttr)},
        ),
        _op("reshard", "Change a value's placements (lowered to the collectives above)."),
    ],
    doc=__doc__ or "",
)
