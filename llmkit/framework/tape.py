"""The autograd tape's data: grad mode, and the :class:`Node` that ``dispatch.apply`` records.

Every differentiable op application made while gradients are enabled records a Node (its op spec,
input tensors, attributes and outputs) on its outputs; ``autograd.py`` walks them backward.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any


class _GradState(threading.local):
    enabled = True  # the class default: a thread that never set it reads True without a miss


grad_mode = _GradState()


def is_grad_enabled() -> bool:
    return grad_mode.enabled


class set_grad_enabled(contextlib.ContextDecorator):
    """Context manager (and decorator) that turns gradient recording on or off."""

    def __init__(self, mode: bool) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        self.prev = is_grad_enabled()
        grad_mode.enabled = self.mode

    def __exit__(self, *exc: Any) -> None:
        grad_mode.enabled = self.prev


def no_grad() -> set_grad_enabled:
    """Ops inside record nothing and their outputs do not require grad."""
    return set_grad_enabled(False)


def enable_grad() -> set_grad_enabled:
    return set_grad_enabled(True)


class Node:
    """One recorded op application: the tape entry that ``backward`` differentiates."""

    __slots__ = ("attrs", "freed", "inputs", "outputs", "spec")

    def __init__(self, spec, inputs: tuple, attrs: dict, outputs: tuple) -> None:
        self.spec = spec
        self.inputs = inputs  # Tensors (constants lifted to Tensors)
        self.attrs = attrs
        self.outputs = outputs  # detached stand-ins of the outputs: what the vjp rule calls `out`
        self.freed = False

    def free(self) -> None:
        self.inputs = self.outputs = ()
        self.freed = True

    def __repr__(self) -> str:
        return f"<Node {self.spec.name}>"
