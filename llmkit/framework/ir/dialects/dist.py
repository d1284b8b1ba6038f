"""``dist``: communication between ranks, generated from the op table's collectives.

One op per op-table entry of kind ``collective`` (see ``ops/collective.py``): ``dist.reshard`` in
global programs, ``dist.all_reduce``, ``dist.all_gather``, ``dist.reduce_scatter``,
``dist.all_to_all``, ``dist.send``, ``dist.recv`` in per-rank programs. Their attributes are typed
(``#mesh<...>``, placements as ``[#shard<0>, #replicate<>]``) and checked by the op's rules. None of
them is pure: passes never drop or merge communication, and the compiler fuses around them.
"""

from __future__ import annotations

from ...opspec import Kind
from .llm import TableDialect

DIALECT = TableDialect("dist", lambda s: s.kind == Kind.COLLECTIVE, doc=__doc__ or "")
