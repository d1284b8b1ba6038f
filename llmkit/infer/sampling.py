"""Choosing the next token from logits (host-side numpy, float64 for stable probabilities).

``SamplingParams`` holds one request's settings; ``sample(logits, params, rng)`` filters and draws.
Greedy is ``temperature == 0``: the argmax, with the lowest id winning ties, so results do not
depend on how requests are batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    seed: int | None = None  # per-request seed; None draws from entropy

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from: temperature, then top-k and top-p filtering. [V] -> [V]."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep tokens up to and including the one that crosses top_p
        cut = int(np.searchsorted(cum, params.top_p) + 1)
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:cut]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a row of logits [V]."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    p = probabilities(logits, params)
    return int(rng.choice(p.shape[0], p=p))
