"""The op table and its public functions.

``ops.<name>(...)`` exists for every op in the table: positional arguments fill the op's tensor
inputs in order, then its attributes; keywords work for both. ``ops.table()`` lists the specs.
Variadic ops (``concat``, ``stack``) take a sequence of tensors first, as numpy does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..dispatch import public
from ..opspec import REQUIRED, A, Kind, Meta, OpError, OpSpec, attr, defop, get, table
from . import collective, contraction, elementwise, indexed, neural, paged, quant, reduce, views  # noqa: F401  (they register ops)


def __getattr__(name: str) -> Callable[..., Any]:
    spec = table().get(name)
    if spec is None:
        raise AttributeError(f"module 'llmkit.framework.ops' has no op {name!r}")
    fn = globals()[name] = public(spec)  # found without this hook from now on
    return fn


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(table()))


__all__ = ["REQUIRED", "A", "Kind", "Meta", "OpError", "OpSpec", "attr", "defop", "get", "public", "table"]
