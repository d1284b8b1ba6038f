"""SGD (with momentum / Nesterov) and AdamW, each an ``init_state`` plus a pure ``update``.

The formulas are PyTorch's (``torch.optim.SGD`` without dampening, ``torch.optim.AdamW``), so
hyperparameters carry over. Hyperparameters other than lr are Python numbers: branching on them
is fine under tracing, where they are part of the program's configuration.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .. import ops
from ..tensor import Tensor
from .optimizer import Optimizer, compute_dtype


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, Nesterov momentum and L2 weight decay.

    With g = grad + weight_decay * p and buffer b (zero at the start)::

        b = momentum * b + g
        d = g + momentum * b   (nesterov)   or   d = b   (classic momentum)   or   d = g   (momentum 0)
        p = p - lr * d

    The zero initial buffer makes the first step's b = g, as PyTorch's copy of the first gradient does.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[Mapping[str, Any]],
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay}
        )

    def validate(self, group: Mapping[str, Any]) -> None:
        super().validate(group)
        if not group["momentum"] >= 0 or not group["weight_decay"] >= 0:
            raise ValueError(
                f"SGD: momentum and weight_decay must be >= 0, got {group['momentum']}, "
                f"{group['weight_decay']}"
            )
        if group["nesterov"] and not group["momentum"] > 0:
            raise ValueError("SGD: nesterov=True needs momentum > 0")

    def init_state(self, param: Tensor, group: Mapping[str, Any]) -> dict[str, Tensor]:
        if not group["momentum"]:
            return {}
        return {"momentum_buffer": ops.zeros_like(param, dtype=compute_dtype(param))}

    def update(
        self, param: Tensor, grad: Tensor, state: Mapping[str, Tensor], group: Mapping[str, Any]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        dt = compute_dtype(param)
        p, g = param.astype(dt), grad.astype(dt)
        if group["weight_decay"]:
            g = g + p * group["weight_decay"]
        new_state = {}
        momentum = group["momentum"]
        if momentum:
            buf = state["momentum_buffer"] * momentum + g
            new_state["momentum_buffer"] = buf
            g = g + buf * momentum if group["nesterov"] else buf
        return p - group["lr"].astype(dt) * g, new_state


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
