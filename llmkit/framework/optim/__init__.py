"""Optimizers (SGD, AdamW), learning-rate schedules and gradient clipping."""

from __future__ import annotations

from .adamw import AdamW
from .clip import clip_grad_norm_
from .lr_scheduler import ConstantLR, LinearDecay, LRScheduler, WarmupCosine
from .optimizer import Optimizer, compute_dtype, flatten_state_dict, unflatten_state_dict
from .sgd import SGD

__all__ = [
    "SGD",
    "AdamW",
    "ConstantLR",
    "LRScheduler",
    "LinearDecay",
    "Optimizer",
    "WarmupCosine",
    "clip_grad_norm_",
    "compute_dtype",
    "flatten_state_dict",
    "unflatten_state_dict",
]
