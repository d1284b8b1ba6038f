"""Parameter initializers, in place (PyTorch's ``torch.nn.init`` names and formulas).

Each draws from the seeded generator of the tensor's device (``lf.seed``), in float64 so that the
values do not depend on the target dtype's random stream, then casts and rebinds the tensor with
``set_value``. Fans follow PyTorch for a weight ``[out, in, *kernel]``: fan_in = in * prod(kernel),
fan_out = out * prod(kernel).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import backend as B
from ..tensor import Tensor

__all__ = [
    "calculate_gain",
    "constant_",
    "kaiming_normal_",
    "kaiming_uniform_",
    "normal_",
    "ones_",
    "skip_init",
    "trunc_normal_",
    "uniform_",
    "xavier_normal_",
    "xavier_uniform_",
    "zeros_",
]


_skipping = threading.local()


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Initializers inside leave tensors as allocated (uninitialized, drawing nothing): for a model
    whose weights are about to be loaded, so that building it touches no memory it does not keep."""
    before = getattr(_skipping, "on", False)
    _skipping.on = True
    try:
        yield
    finally:
        _skipping.on = before


def _fill(t: Tensor, draw: Callable[[Any, Any], Any]) -> Tensor:
    """Rebind ``t`` to ``draw(generator, xp)`` (a float64 array of t's shape) cast to t's dtype."""
    if getattr(_skipping, "on", False):
        return t
    t.set_value(draw(B.generator(t.device), B.xp_for(t.device)).astype(t.dtype))
    return t


def uniform_(t: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
    """t ~ U(a, b)."""
    return _fill(t, lambda g, xp: a + (b - a) * g.random(t.shape, dtype=np.float64))


def normal_(t: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
    """t ~ N(mean, std²)."""
    return _fill(t, lambda g, xp: mean + std * g.standard_normal(t.shape, dtype=np.float64))


def trunc_normal_(t: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Tensor:
    """t ~ N(mean, std²) conditioned on a <= t <= b (a and b are absolute bounds, as in PyTorch)."""
    if not a < b:
        raise ValueError(f"trunc_normal_: need a < b, got a={a}, b={b}")

    def draw(g: Any, xp: Any) -> Any:
        out = mean + std * g.standard_normal(t.shape, dtype=np.float64)
        bad = (out < a) | (out > b)
        # Rejection sampling: each round keeps the in-range draws; the window holds at least a
        # few percent of the mass in any sensible use, so a handful of rounds suffice.
        while bool(bad.any()):
            redraw = mean + std * g.standard_normal(t.shape, dtype=np.float64)
            out = xp.where(bad, redraw, out)
            bad = (out < a) | (out > b)
        return out

    return _fill(t, draw)


def constant_(t: Tensor, value: float) -> Tensor:
    return _fill(t, lambda g, xp: xp.full(t.shape, value, dtype=np.float64))


def zeros_(t: Tensor) -> Tensor:
    return constant_(t, 0.0)


def ones_(t: Tensor) -> Tensor:
    return constant_(t, 1.0)


def _fans(t: Tensor) -> tuple[int, int]:
    if t.ndim < 2:
        raise ValueError(f"fan in and fan out need a tensor with at least 2 dims, got shape {list(t.shape)}")
    receptive = math.prod(t.shape[2:])
    return t.shape[1] * receptive, t.shape[0] * receptive


_GAINS: dict[str, Callable[[float], float]] = {
    "linear": lambda _: 1.0,
    "identity": lambda _: 1.0,
    "sigmoid": lambda _: 1.0,
    "tanh": lambda _: 5.0 / 3,
    "relu": lambda _: math.sqrt(2.0),
    "leaky_relu": lambda slope: math.sqrt(2.0 / (1 + slope**2)),
    "selu": lambda _: 3.0 / 4,
}


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The std gain that keeps activations' variance stable through ``nonlinearity`` (PyTorch's table)."""
    rule = _GAINS.get(nonlinearity)
    if rule is None:
        raise ValueError(
            f"calculate_gain: unknown nonlinearity {nonlinearity!r}; expected one of {', '.join(_GAINS)}"
        )
    return rule(0.01 if param is None else param)


def xavier_uniform_(t: Tensor, gain: float = 1.0) -> Tensor:
    """t ~ U(-r, r), r = gain * sqrt(6 / (fan_in + fan_out))."""
    fan_in, fan_out = _fans(t)
    r = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(t, -r, r)


def xavier_normal_(t: Tensor, gain: float = 1.0) -> Tensor:
    """t ~ N(0, std²), std = gain * sqrt(2 / (fan_in + fan_out))."""
    fan_in, fan_out = _fans(t)
    return normal_(t, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))


def _kaiming_std(t: Tensor, a: float, mode: str, nonlinearity: str) -> float:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"kaiming init: mode must be 'fan_in' or 'fan_out', got {mode!r}")
    fan_in, fan_out = _fans(t)
    return calculate_gain(nonlinearity, a) / math.sqrt(fan_in if mode == "fan_in" else fan_out)


def kaiming_uniform_(
    t: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu"
) -> Tensor:
    """t ~ U(-r, r), r = sqrt(3) * gain / sqrt(fan); ``a`` is the leaky-ReLU slope in the gain."""
    r = math.sqrt(3.0) * _kaiming_std(t, a, mode, nonlinearity)
    return uniform_(t, -r, r)


def kaiming_normal_(
    t: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu"
) -> Tensor:
    """t ~ N(0, std²), std = gain / sqrt(fan)."""
    return normal_(t, 0.0, _kaiming_std(t, a, mode, nonlinearity))
