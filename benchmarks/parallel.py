"""Collectives over MPI: measured time against the alpha-beta model, all-reduce latency and bandwidth.

For 2 and 4 processes (the script relaunches itself under ``mpiexec``), each rank times what users
call, ``dist.reshard`` on a 1-D mesh of all ranks, for the four collectives a reshard runs:

    P -> R  all-reduce      ring: 2(n-1) steps, each rank sends 2(n-1)/n * N bytes
    S -> R  all-gather            (n-1) steps,                    (n-1)/n * N
    P -> S  reduce-scatter        (n-1) steps,                    (n-1)/n * N
    S -> S  all-to-all            (n-1) steps,                    (n-1)/n^2 * N

(N: the tensor's global bytes; the per-rank bytes are ``ops.spmd.move_cost``, what the SPMD rules
choose by). One alpha (seconds per step) and beta (seconds per byte) are fitted to every
measurement of a process count (least squares, T = alpha * steps + beta * bytes), and each line
reports the measured time beside the model's prediction. Latency is the 8-byte all-reduce;
bus bandwidth is 2(n-1)/n * N / T at the largest size. The backend's own all-reduce (no reshard
planning, no distributed tensor) is timed in the same run: the difference is the framework's
overhead per collective.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/parallel.py [--sizes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from _common import emit, machine

KINDS = {  # name: (source, target, ring steps as a function of n)
    "all_reduce": ("P", "R", lambda n: 2 * (n - 1)),
    "all_gather": ("S(0)", "R", lambda n: n - 1),
    "reduce_scatter": ("P", "S(0)", lambda n: n - 1),
    "all_to_all": ("S(0)", "S(1)", lambda n: n - 1),
}


def worker(sizes: list[int], repeat: int) -> None:
    import llmkit.framework.distributed as dist
    from llmkit.framework.ops.spmd import move_cost
    from llmkit.framework.placement import Placement

    dist.init("mpi", timeout=120)
    n, me = dist.get_world_size(), dist.get_rank()
    mesh = dist.ProcessMesh((n,), ["x"])
    rows = []
    for kind, (src, dst, steps) in KINDS.items():
        for nbytes in sizes:
            side = n * max(1, round(np.sqrt(nbytes / 4) / n))  # float32 [side, side]: even splits
            g = np.ones((side, side), np.float32)
            shape = g.shape
            size = g.nbytes
            local = dist.from_local(g if src == "P" else np.array_split(g, n)[me], mesh, [src], shape)
            times = []
            for i in range(repeat + 2):
                dist.get_backend().barrier()
                t0 = time.perf_counter()
                dist.reshard(local, mesh, [dst])
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            t = float(np.median(times))
            sent = move_cost(Placement.parse(src), Placement.parse(dst), size, n)
            rows.append({"kind": kind, "bytes": size, "steps": steps(n), "sent": sent, "seconds": t})
            if kind == "all_reduce":  # the transport alone: the backend's all-reduce of the same array
                backend, times = dist.get_backend(), []
                for i in range(repeat + 2):
                    backend.barrier()
                    t0 = time.perf_counter()
                    backend.all_reduce(tuple(range(n)), {me: g}, "sum")
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                raw = {"kind": "backend_all_reduce", "bytes": size, "steps": steps(n), "sent": sent}
                rows.append({**raw, "seconds": float(np.median(times))})
    # every rank timed the same collectives: the slowest rank's time is the collective's
    ranks = tuple(range(n))
    slowest = dist.get_backend().all_reduce(ranks, {me: np.array([r["seconds"] for r in rows])}, "max")[me]
    if me == 0:
        for r, s in zip(rows, slowest):
            r["seconds"] = float(s)
        print(json.dumps({"n": n, "rows": rows}), flush=True)


def report(n: int, rows: list[dict]) -> None:
    raw = {r["bytes"]: r["seconds"] for r in rows if r["kind"] == "backend_all_reduce"}
    rows = [r for r in rows if r["kind"] != "backend_all_reduce"]
    a = np.array([[r["steps"], r["sent"]] for r in rows], float)
    t = np.array([r["seconds"] for r in rows])
    (alpha, beta), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)  # relative error fit
    for r in rows:
        pred = alpha * r["steps"] + beta * r["sent"]
        emit(
            "parallel",
            f"{r['kind']}_n{n}_{r['bytes']}B",
            r["seconds"] * 1e6,
            "us",
            predicted_us=round(pred * 1e6, 1),
            error_pct=round(100 * (pred - r["seconds"]) / r["seconds"], 1),
            bytes_sent_per_rank=round(r["sent"]),
        )
    emit("parallel", f"alpha_n{n}", alpha * 1e6, "us", note="seconds per ring step (latency term)")
    emit("parallel", f"beta_n{n}", 1e-9 / beta if beta > 0 else float("inf"), "GB/s", note="1/beta")
    ar = [r for r in rows if r["kind"] == "all_reduce"]
    small, big = min(ar, key=lambda r: r["bytes"]), max(ar, key=lambda r: r["bytes"])
    emit(
        "parallel",
        f"all_reduce_latency_n{n}",
        small["seconds"] * 1e6,
        "us",
        bytes=small["bytes"],
        backend_only_us=round(raw[small["bytes"]] * 1e6, 1),
    )
    bus = 2 * (n - 1) / n * big["bytes"] / big["seconds"]
    raw_bus = 2 * (n - 1) / n * big["bytes"] / raw[big["bytes"]]
    emit(
        "parallel",
        f"all_reduce_bus_bandwidth_n{n}",
        bus / 1e9,
        "GB/s",
        bytes=big["bytes"],
        backend_only_gbs=round(raw_bus / 1e9, 3),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 1 << 10, 1 << 16, 1 << 20, 1 << 23])
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.sizes, args.repeat)
        return
    if shutil.which("mpiexec") is None:
        sys.exit("benchmarks/parallel.py needs mpiexec (pip install -e '.[dist]')")
    emit("parallel", "machine", 0, "", **machine())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    for n in args.procs:
        cmd = ["mpiexec", "--oversubscribe", "--allow-run-as-root", "-n", str(n), sys.executable, __file__]
        cmd += ["--worker", "--repeat", str(args.repeat), "--sizes", *map(str, args.sizes)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if out.returncode != 0:
            sys.exit(f"mpiexec -n {n} failed:\n{out.stderr[-3000:]}")
        got = json.loads(out.stdout.strip().splitlines()[-1])
        report(got["n"], got["rows"])


if __name__ == "__main__":
    main()
