"""Flatten nested Python structures of tensors into a leaf list and a tree to rebuild them.

Containers: tuple, list, dict (sorted keys), None, and dataclass instances (fields in order), so a
model output such as ``CausalLMOutput(logits, loss, kv_cache)`` round-trips.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..tensor import Tensor

Leaf = Any


def flatten(obj: Any) -> tuple[list[Leaf], Any]:
    """(leaves, tree): tensors are leaves; other non-container values are kept in the tree."""
    leaves: list[Leaf] = []

    def walk(x: Any) -> Any:
        if isinstance(x, Tensor):
            leaves.append(x)
            return ("leaf",)
        if isinstance(x, (tuple, list)):
            return (type(x), tuple(walk(v) for v in x))
        if isinstance(x, dict):
            keys = sorted(x)
            return (dict, tuple(keys), tuple(walk(x[k]) for k in keys))
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = [f.name for f in dataclasses.fields(x)]
            return ("dataclass", type(x), tuple(fields), tuple(walk(getattr(x, f)) for f in fields))
        return ("const", x)

    return leaves, walk(obj)


def unflatten(tree: Any, leaves: list[Leaf]) -> Any:
    it = iter(leaves)

    def build(t: Any) -> Any:
        tag = t[0]
        if tag == "leaf":
            return next(it)
        if tag == "const":
            return t[1]
        if tag is dict:
            return {k: build(v) for k, v in zip(t[1], t[2])}
        if tag == "dataclass":
            return t[1](**{f: build(v) for f, v in zip(t[2], t[3])})
        return tag(build(v) for v in t[1])

    return build(tree)
