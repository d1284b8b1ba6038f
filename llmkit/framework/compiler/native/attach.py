"""``native_kernel``: how a family module attaches its C kernel to an op's spec (its own module, below
the family modules that call it and the package that imports them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...opspec import Native, get


def native_kernel(
    op: str,
    source: str | Callable[..., str],
    *,
    sizes: Callable[..., Sequence[int]],
    applies: Callable[..., bool],
    strided: bool = False,
    eager: bool = True,
) -> Native:
    """Attach a hand-written kernel to op ``op``'s spec (see :class:`opspec.Native`)."""
    spec = get(op)
    if spec.native is not None:
        raise ValueError(f"op {op!r} has a native kernel already")
    spec.native = Native(source, sizes, applies, strided, eager)
    return spec.native
