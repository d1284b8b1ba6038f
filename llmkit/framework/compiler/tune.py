"""The tuner: time a kernel's candidate schedules once per shape class, keep the winner on disk.

A *shape class* buckets each size argument by its power of two, so a new batch size or sequence
length in the same bucket reuses the decision. Candidates are the schedules ``loop_schedule`` offers
(rows / column tiles) times the thread counts (1 or every core, passed at call time). Each is timed
on the real inputs (a few runs, the median); the winner goes to ``tune.json`` next to the kernels,
keyed by kernel, class and core count. ``LLMKIT_CINN_TUNE=0`` skips timing (first candidate,
all cores).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence

from ..files import atomic_write
from .build import cache_dir

_memory: dict[str, tuple[int, int]] = {}
_loaded = False


def shape_class(sizes: Sequence[int]) -> str:
    return ",".join(str(int(s).bit_length()) for s in sizes)


def _path():
    return cache_dir() / "tune.json"


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    try:
        data = json.loads(_path().read_text())
        _memory.update({k: tuple(v) for k, v in data.items()})
    except (OSError, ValueError):
        pass


_saving = threading.Lock()


def forget() -> None:
    """Drop remembered decisions (the next lookup reads the disk again)."""
    global _loaded
    _memory.clear()
    _loaded = False


def _save(key: str, choice: tuple[int, int]) -> None:
    """Add one decision to the file. Threads of one process (sim ranks) take turns; every writer,
    of this process or another, writes its own temporary file and swaps it in whole."""
    path = _path()
    with _saving:
        try:
            data = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            data = {}
        data[key] = list(choice)
        atomic_write(path, json.dumps(data, indent=0, sort_keys=True))


def enabled() -> bool:
    return os.environ.get("LLMKIT_CINN_TUNE", "1") not in ("0", "off", "false")


def choose(
    key: str, n_candidates: int, threads: Sequence[int], run: Callable[[int, int], None]
) -> tuple[int, int]:
    """The best (candidate, threads) for ``key``; times ``run(candidate, threads)`` on a miss."""
    _load()
    hit = _memory.get(key)
    if hit is not None and hit[0] < n_candidates:
        return hit
    options = [(c, t) for c in range(n_candidates) for t in threads]
    if not enabled():
        return (0, max(threads))
    if len(options) == 1:
        return options[0]
    times = {}
    for opt in options:
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            run(*opt)
            samples.append(time.perf_counter() - t0)
            if sum(samples) > 0.05:
                break
        times[opt] = statistics.median(samples)
    best = min(options, key=lambda o: times[o])
    _memory[key] = best
    _save(key, best)
    return best
