"""Gradient clipping by the global L2 norm, without reading any value back to the host."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from .. import ops
from ..tape import no_grad
from ..tensor import Tensor
from .optimizer import compute_dtype


def clip_grad_norm_(
    parameters: Iterable[Tensor] | Tensor,
    max_norm: float,
    eps: float = 1e-6,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Scale all gradients so their global L2 norm is at most ``max_norm``; return the norm before.

    norm = sqrt(Σ_p Σ_i grad_p[i]²) (accumulated in float32, or float64 if any gradient is),
    and every gradient is multiplied by min(1, max_norm / (norm + eps)). The multiply always
    happens (by 1 when no clipping is needed) because deciding would need the norm on the host.
    Gradients are rebound with ``set_value``; parameters without a gradient are skipped.
    ``reduce`` maps this process's sum of squares to the whole model's, where other processes
    hold the other parameters (a pipeline's stages).
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return ops.full([], 0.0, dtype="float32")
    acc = np.dtype(np.float64) if any(g.dtype == np.float64 for g in grads) else np.dtype(np.float32)
    with no_grad():
        squares = [ops.sum(ops.mul(g.astype(acc), g.astype(acc))) for g in grads]
        total = squares[0] if len(squares) == 1 else ops.sum(ops.stack(squares))
        norm = ops.sqrt(total if reduce is None else reduce(total))
        scale = ops.minimum(max_norm / (norm + eps), 1.0)
        for g in grads:
            dt = compute_dtype(g)  # scale half-precision gradients in float32, then round once
            g.set_value((g.astype(dt) * scale.astype(dt)).astype(g.dtype))
    return norm
