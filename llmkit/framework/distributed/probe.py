"""This machine's speeds for the planner, measured once and cached: matmul FLOP/s, memory bandwidth,
and the alpha-beta model of a backend's collectives.

``local_machine(backend)`` reads ``~/.cache/llmkit/planner-probe.json`` (or ``$LLMKIT_CACHE_DIR``)
keyed by host, cores, numpy and backend, and probes what is missing: a float32 1024-wide matmul
(best of 5), a 32 MB elementwise add (best of 5), and for the backend an all-reduce of 8 bytes and
of 4 MB between two ranks (``sim``: two simulated ranks in this process; ``mpi``: ``mpiexec -n 2``
of this module), which give alpha (the small one's time per ring step) and beta (the large one's
remaining seconds per byte sent).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..files import atomic_write, cache_root
from .parallel_plan import PlanError
from .plan_search import Link, Machine, scaled

SIZES = (8, 4 << 20)


def cache_file() -> Path:
    return cache_root() / "planner-probe.json"


def _best(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def compute_speeds() -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s) of this process's numpy."""
    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    flops = 2 * n**3 / _best(lambda: a @ b)
    x = np.ones(8 << 20, np.float32)
    y = np.empty_like(x)
    bandwidth = 3 * x.nbytes / _best(lambda: np.add(x, x, out=y))  # two reads, one write
    return flops, bandwidth


def collective_times(backend: str) -> list[float]:
    """Seconds of a 2-rank all-reduce of each of SIZES bytes (median of 10) under ``backend``."""
    if backend == "mpi":
        mpiexec = shutil.which("mpiexec")
        if mpiexec is None:
            raise PlanError(
                "backend", "probing mpi needs mpiexec on PATH (pip install 'llmkit[dist]'), or --backend sim"
            )
        cmd = [mpiexec, "--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
        cmd += ["-n", "2", sys.executable, "-m", "llmkit.framework.distributed.probe"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    import llmkit.framework.distributed as dist

    dist.init(backend)
    return _time_all_reduce(dist)


def _time_all_reduce(dist) -> list[float]:
    comm = dist.get_backend()
    group = (0, 1)
    out = []
    for nbytes in SIZES:
        xs = {r: np.ones(nbytes // 4, np.float32) for r in comm.hosted(group)}
        times = []
        for _ in range(12):
            comm.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(group, xs, "sum")
            times.append(time.perf_counter() - t0)
        out.append(float(np.median(times[2:])))
    return out


def local_machine(
    backend: str = "sim",
    ranks: int = 1,
    step_speed: tuple[str, Callable[[], tuple[float, float]]] | None = None,
) -> Machine:
    """This host as a Machine for ``ranks`` ranks on ``backend`` (probed once, then cached).
    ``step_speed``: (a key naming the model's shape, a probe of its training FLOP/s and its
    optimizer's parameters per second here): the model's own kernels' speeds replace the bare
    matmul's and the memory bandwidth's."""
    # one rank talks to nobody: no backend to probe
    key = f"{platform.node()}/{os.cpu_count()}/numpy-{np.__version__}/{backend if ranks > 1 else 'alone'}"
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        cache = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        cache = {}
    hit = cache.get(key)
    if hit is None:
        flops, bandwidth = compute_speeds()
        small, big = collective_times(backend) if ranks > 1 else (0.0, 0.0)
        alpha = small / 2  # a 2-rank ring all-reduce: 2 steps
        beta = max(big - small, 0.0) / SIZES[1]  # each rank sends 2 (n-1)/n N = N bytes
        hit = cache[key] = {"flops": flops, "bandwidth": bandwidth, "alpha": alpha, "beta": beta}
        atomic_write(path, json.dumps(cache, indent=1) + "\n")
    flops, bandwidth, update = hit["flops"], hit["bandwidth"], None
    if step_speed is not None:
        name, probe = step_speed
        speeds = cache.setdefault("step_speed", {})
        mine = f"{key}/{name}"
        if mine not in speeds:
            speeds[mine] = probe()
            atomic_write(path, json.dumps(cache, indent=1) + "\n")
        flops, update = speeds[mine]
    link = Link(hit["alpha"], hit["beta"])
    cores = os.cpu_count() or 1
    host = Machine(
        f"this host ({backend})",
        flops,
        bandwidth,
        link,
        link,
        node=max(ranks, 1),
        peak_flops=hit["flops"],  # MFU here: against a bare matmul's speed
        whole_step=step_speed is not None,
        update_rate=update,
    )
    return scaled(host, ranks, cores)


if __name__ == "__main__":  # one rank of the mpi probe
    import llmkit.framework.distributed as dist

    dist.init("mpi", timeout=60)
    times = _time_all_reduce(dist)
    if dist.get_rank() == 0:
        print(json.dumps(times), flush=True)
