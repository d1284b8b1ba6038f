"""The dialects: ``builtin``, ``llm`` (generated from the op table), ``cinn`` and ``dist``."""

from __future__ import annotations

from ..opdef import register_dialect
from . import builtin, cinn, dist, llm

for _d in (builtin.DIALECT, llm.DIALECT, cinn.DIALECT, dist.DIALECT):
    register_dialect(_d)

__all__ = ["builtin", "cinn", "dist", "llm"]
