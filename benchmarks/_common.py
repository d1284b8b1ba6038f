"""Shared helpers for benchmarks: timing with medians and one JSON line per figure."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def median_time(fn: Callable[[], Any], repeat: int = 7, warmup: int = 2, number: int = 1) -> float:
    """Median wall time of ``fn`` in seconds (each sample averages ``number`` calls)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def emit(benchmark: str, metric: str, value: float, unit: str, **extra: Any) -> None:
    """Print one figure as a JSON line."""
    row = {"benchmark": benchmark, "metric": metric, "value": round(value, 6), "unit": unit, **extra}
    print(json.dumps(row), flush=True)


def emit_paired_ratio(
    benchmark: str, metric: str, ours: list[float], theirs: list[float], **extra: Any
) -> None:
    """The median over rounds of ours / theirs within each round (the two measured in the same
    stretch of this drifting VM), with every round's ratio."""
    per_round = [o / t for o, t in zip(ours, theirs)]
    rounded = [round(r, 3) for r in per_round]
    emit(benchmark, metric, statistics.median(per_round), "x", per_round=rounded, **extra)


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "blas_env_unset": "OPENBLAS_CORETYPE" not in os.environ,
        "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
    }
