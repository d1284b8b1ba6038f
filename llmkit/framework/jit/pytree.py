"""Flatten nested Python structures of tensors into a leaf list and a tree to rebuild them.

Containers: tuple, list, dict (sorted keys), None, and dataclass instances (fields in order), so a
model output such as ``CausalLMOutput(logits, loss, kv_cache)`` round-trips.

Both walks are module-level functions, not closures that call themselves: such a closure is a
reference cycle holding its leaves until the cyclic GC runs, so every output of a ``to_static``
call would outlive the call (a fresh, page-faulted buffer at every call instead of the one just
freed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..tensor import Tensor

Leaf = Any


def flatten(obj: Any) -> tuple[list[Leaf], Any]:
    """(leaves, tree): tensors are leaves; other non-container values are kept in the tree."""
    leaves: list[Leaf] = []
    return leaves, _walk(obj, leaves)


def _walk(x: Any, leaves: list[Leaf]) -> Any:
    if isinstance(x, Tensor):
        leaves.append(x)
        return ("leaf",)
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_walk(v, leaves) for v in x))
    if isinstance(x, dict):
        keys = sorted(x)
        return (dict, tuple(keys), tuple(_walk(x[k], leaves) for k in keys))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = [f.name for f in dataclasses.fields(x)]
        return ("dataclass", type(x), tuple(fields), tuple(_walk(getattr(x, f), leaves) for f in fields))
    return ("const", x)


def unflatten(tree: Any, leaves: list[Leaf]) -> Any:
    """The structure ``tree`` describes, with ``leaves`` in its leaf positions (in order)."""
    return _build(tree, iter(leaves))


def _build(t: Any, it: Any) -> Any:
    tag = t[0]
    if tag == "leaf":
        return next(it)
    if tag == "const":
        return t[1]
    if tag is dict:
        return {k: _build(v, it) for k, v in zip(t[1], t[2])}
    if tag == "dataclass":
        return t[1](**{f: _build(v, it) for f, v in zip(t[2], t[3])})
    return tag(_build(v, it) for v in t[1])
