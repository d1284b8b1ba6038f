"""``import llmkit.framework.nn.functional as F``: every op of the table, plus a few wrappers.

The wrappers here add behaviour an op cannot have (a ``training`` switch, a fresh random seed per
call, PyTorch-style padding built from ``concat``). Every other name resolves to ``lf.ops`` through
the module ``__getattr__`` below, so ``F.softmax``, ``F.cross_entropy``, ``F.linear``... are the
ops themselves and there is no second list of ops to keep in sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import backend as B
from .. import ops
from ..dispatch import current_world
from ..tensor import Tensor

__all__ = ["dropout", "pad"]


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero each element with probability p and scale the rest by 1/(1-p); identity when not training.

    Each call draws a fresh seed from the CPU generator (``lf.seed``), so runs are reproducible and
    the backward pass reuses the forward's mask (the op regenerates it from the seed). Traced into a
    static program, the mask is a function of the program's ``run_seed`` input, drawn from the same
    generator at every run, and of the op's place in the program: each call draws new masks.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    traced = current_world().run_seed()
    if traced is None:
        return ops.dropout(x, p=p, seed=B.random_seed())
    return ops.dropout(x, traced[0], p=p, seed=traced[1])


def pad(x: Tensor, pad: Sequence[int], value: float = 0.0) -> Tensor:
    """Constant padding in PyTorch's order: ``(left, right)`` for the last axis, then the one before...

    ``pad(x, (1, 2))`` on ``[B, S]`` gives ``[B, S + 3]``; ``pad(x, (0, 0, 3, 0))`` prepends 3 rows to
    the second-to-last axis. Built from ``full`` and ``concat``, so it differentiates and traces.
    """
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise ValueError(f"pad: expects pairs (before, after) for at most {x.ndim} axes, got {tuple(pad)}")
    if any(int(n) < 0 for n in pad):
        raise ValueError(f"pad: widths must be >= 0 (crop with slicing instead), got {tuple(pad)}")
    for i in range(len(pad) // 2):
        axis = x.ndim - 1 - i
        before, after = int(pad[2 * i]), int(pad[2 * i + 1])
        if before or after:
            x = ops.concat([*_block(x, axis, before, value), x, *_block(x, axis, after, value)], axis=axis)
    return x


def _block(x: Tensor, axis: int, width: int, value: float) -> list[Tensor]:
    """A constant block shaped like x but ``width`` long on ``axis`` (none when width is 0)."""
    if not width:
        return []
    shape = list(x.shape)
    shape[axis] = width
    return [ops.full(shape, value, dtype=x.dtype)]


def __getattr__(name: str) -> Callable[..., Any]:
    try:
        return getattr(ops, name)
    except AttributeError:
        raise AttributeError(
            f"module 'llmkit.framework.nn.functional' has no attribute {name!r}: "
            "it is neither a wrapper here nor an op in lf.ops.table()"
        ) from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(ops.table()))
