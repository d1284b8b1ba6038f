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


def llama_134m() -> Any:
    """The 134M Llama the quantization and llama.cpp figures use (hidden 768, 12 layers, vocab 32000,
    untied head), with random weights: one definition for every benchmark."""
    from llmkit.models.llama import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=1024,
    )


def load_average() -> float:
    """The 1-minute load average (``uptime``'s first figure): how shared the machine was."""
    return round(os.getloadavg()[0], 2)


def engine_steps(engine: Any, batch: int, prompt_len: int, new_tokens: int) -> list[float]:
    """Seconds per engine step while ``batch`` requests decode (their prefill step excluded)."""
    import numpy as np  # not at the top: numpy must load after llmkit (see llmkit/__init__.py)

    from llmkit.infer import SamplingParams

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(3, engine.spec.vocab_size, prompt_len).tolist(), params)
    engine.step()  # admission + prefill + first tokens
    times = []
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[:-1] or times  # the last step only finishes requests
