"""SGD with momentum (classic or Nesterov) and L2 weight decay: ``init_state`` plus a pure ``update``.

The formula is PyTorch's (``torch.optim.SGD`` without dampening), so hyperparameters carry over.
Hyperparameters other than lr are Python numbers: branching on them is fine under tracing, where
they are part of the program's configuration.
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
