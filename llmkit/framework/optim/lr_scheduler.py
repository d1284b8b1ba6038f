"""Learning-rate schedules: closed-form multipliers of each group's base lr, by step.

A schedule is attached to an optimizer: at construction it records every group's ``lr`` as its
base and sets the lr of step 0; each ``sched.step()`` (called after ``opt.step()``) advances one
step and writes ``base * factor(step)`` into every group. Schedules run on the host, in Python
floats; the optimizer copies ``group["lr"]`` into its 0-d lr tensor at each step, so a traced
training step reads the scheduled value as an input.

Warmup is linear and never zero: step s < warmup_steps uses factor (s + 1) / warmup_steps, so the
first update already moves the weights and step warmup_steps - 1 reaches the full lr.
"""

from __future__ import annotations

import math
from typing import Any

from .optimizer import Optimizer


class LRScheduler:
    """Base class: subclasses define ``factor(step)`` and list their settings in ``_config``."""

    _config: tuple[str, ...] = ()

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.last_step = 0
        self._apply()

    def factor(self, step: int) -> float:
        """The multiplier of the base lr at ``step`` (0-based count of optimizer steps taken)."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        """Every group's lr at the current step."""
        f = self.factor(self.last_step)
        return [base * f for base in self.base_lrs]

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: the schedule's type and settings, base lrs and the step reached."""
        return {
            "type": type(self).__name__,
            "last_step": self.last_step,
            "base_lrs": list(self.base_lrs),
            **{k: getattr(self, k) for k in self._config},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type", type(self).__name__) != type(self).__name__:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state is from a {state['type']}")
        if len(state["base_lrs"]) != len(self.base_lrs):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: {len(state['base_lrs'])} base lrs saved, "
                f"the optimizer has {len(self.base_lrs)} groups"
            )
        for k in self._config:
            setattr(self, k, state[k])
        self.base_lrs = [float(v) for v in state["base_lrs"]]
        self.last_step = int(state["last_step"])
        self._apply()

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={getattr(self, k)}" for k in self._config)
        return f"{type(self).__name__}({settings}, step={self.last_step})"


def _warmup(step: int, warmup_steps: int) -> float | None:
    """The warmup factor, or None once warmup is over."""
    return (step + 1) / warmup_steps if step < warmup_steps else None


def _check(warmup_steps: int, total_steps: int | None = None) -> None:
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps is not None and total_steps < warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")


class ConstantLR(LRScheduler):
    """factor(s) = (s + 1) / warmup_steps during warmup, then 1."""

    _config = ("warmup_steps",)

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 0) -> None:
        _check(warmup_steps)
        self.warmup_steps = warmup_steps
        super().__init__(optimizer)

    def factor(self, step: int) -> float:
        w = _warmup(step, self.warmup_steps)
        return 1.0 if w is None else w


class _WarmupDecay(LRScheduler):
    """Linear warmup, then ``decay(q)`` over q = (s - warmup_steps) / (total_steps - warmup_steps)
    clipped to [0, 1] (so flat after total_steps). Subclasses give ``decay``."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int, total_steps: int) -> None:
        _check(warmup_steps, total_steps)
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        super().__init__(optimizer)

    def decay(self, q: float) -> float:
        raise NotImplementedError

    def factor(self, step: int) -> float:
        w = _warmup(step, self.warmup_steps)
        if w is not None:
            return w
        return self.decay(min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)))


class WarmupCosine(_WarmupDecay):
    """Linear warmup, then cosine decay from 1 to ``min_lr_ratio`` at ``total_steps``, then flat:
    factor = min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * q)) / 2 after warmup."""

    _config = ("warmup_steps", "total_steps", "min_lr_ratio")

    def __init__(
        self, optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
    ) -> None:
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer, warmup_steps, total_steps)

    def decay(self, q: float) -> float:
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * q))


class LinearDecay(_WarmupDecay):
    """Linear warmup, then linear decay from 1 to ``end_ratio`` at ``total_steps``, then flat:
    factor = 1 - (1 - end_ratio) * q after warmup."""

    _config = ("warmup_steps", "total_steps", "end_ratio")

    def __init__(
        self, optimizer: Optimizer, warmup_steps: int, total_steps: int, end_ratio: float = 0.0
    ) -> None:
        self.end_ratio = end_ratio
        super().__init__(optimizer, warmup_steps, total_steps)

    def decay(self, q: float) -> float:
        return 1.0 - (1.0 - self.end_ratio) * q
