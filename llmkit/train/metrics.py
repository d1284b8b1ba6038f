"""Run metrics: the append-only ``metrics.jsonl`` and the machine's matmul peak for MFU."""

from __future__ import annotations

import json
import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.framework.files import atomic_write

# the file in a job's directory that describes its run (what ``llmkit plot`` reads)
METRICS = "metrics.jsonl"  # llmkit train, llmkit rlhf: one JSON object per logged step
QUANT_REPORT = "quant_report.json"  # llmkit quantize: perplexities, KL, top-1 agreement, bytes


class MetricsLog:
    """One JSON object per line. On resume, lines after the resumed step are dropped first, so the
    file always describes one consistent run."""

    def __init__(self, path: str | os.PathLike[str], truncate_after: int | None = None) -> None:
        self.path = Path(path)
        if self.path.exists():
            rows = read_metrics(self.path)
            if truncate_after is not None:
                rows = [r for r in rows if r.get("step", 0) <= truncate_after]
            atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write
    return rows


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (ru_maxrss: kilobytes on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@lru_cache(maxsize=2)
def matmul_peak_flops(device: str = "cpu", n: int = 1024, repeat: int = 5) -> float:
    """FLOP/s of a float32 n x n matmul on ``device`` (best of ``repeat``): the MFU denominator.
    On the GPU the product is 4096 wide (1024 is launch-bound there) and the device is synchronized."""
    from llmkit.framework import backend as B

    xp = B.xp_for(device)
    n = n if device == "cpu" else max(n, 4096)
    a = xp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
    b = a.T.copy()
    sync = (lambda: None) if xp is np else xp.cuda.Device().synchronize

    def product():
        a @ b
        sync()

    product()  # warm up the BLAS threads (or cuBLAS's handle)
    best = min(_timed(product) for _ in range(repeat))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
