"""AdamW (Loshchilov & Hutter): ``init_state`` plus a pure ``update``.

The formula is PyTorch's (``torch.optim.AdamW``), so hyperparameters carry over. Hyperparameters
other than lr are Python numbers: branching on them is fine under tracing, where they are part of
the program's configuration.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .. import ops
from ..tensor import Tensor
from .optimizer import Optimizer, compute_dtype


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), with bias correction.

    At step t (1-based), with g the gradient::

        p = p * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g            v = b2 * v + (1 - b2) * g²
        p = p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    Moments are kept in float32 for half-precision parameters (see ``compute_dtype``).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[Mapping[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def validate(self, group: Mapping[str, Any]) -> None:
        super().validate(group)
        b1, b2 = group["betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"AdamW: betas must be in [0, 1), got {group['betas']}")
        if not group["eps"] >= 0 or not group["weight_decay"] >= 0:
            raise ValueError(
                f"AdamW: eps and weight_decay must be >= 0, got {group['eps']}, {group['weight_decay']}"
            )

    def init_state(self, param: Tensor, group: Mapping[str, Any]) -> dict[str, Tensor]:
        dt = compute_dtype(param)
        return {"exp_avg": ops.zeros_like(param, dtype=dt), "exp_avg_sq": ops.zeros_like(param, dtype=dt)}

    def update(
        self, param: Tensor, grad: Tensor, state: Mapping[str, Tensor], group: Mapping[str, Any]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        dt = compute_dtype(param)
        p, g = param.astype(dt), grad.astype(dt)
        lr, t = group["lr"].astype(dt), group["step"].astype(dt)
        b1, b2 = group["betas"]
        if group["weight_decay"]:
            p = p * (1.0 - lr * group["weight_decay"])
        m = state["exp_avg"] * b1 + g * (1.0 - b1)
        v = state["exp_avg_sq"] * b2 + g * g * (1.0 - b2)
        bias1 = 1.0 - b1**t  # 0-d tensors: b^t with the step as a tensor, never a baked constant
        bias2 = 1.0 - b2**t
        p = p - (lr / bias1) * m / (ops.sqrt(v) / ops.sqrt(bias2) + group["eps"])
        return p, {"exp_avg": m, "exp_avg_sq": v}
