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

``--training``: parallel training instead. Each strategy of ``llmkit train configs/bench.yaml``
(dp=2, tp=2, tp=2 with sp, dp=2 x tp=2, ZeRO 1/2/3 on dp=2; eager, and static for two of them;
pp=2 with 1f1b and zero_bubble over 4 micro-batches, eager and static)
runs over MPI as the CLI runs it (one process per rank, the config's ``parallel`` section); every
collective the ranks run is counted as the bytes a ring sends per rank, and each strategy reports
its step time (median, beside one process in the same run), communication bytes per step against
the plan's prediction (``models/llama/sharding.py: predict_traffic``; a pipeline's: the activation
crossing the stage boundary, sent point to point), and the parameter + gradient + optimizer bytes
of the fullest rank against the plan's (``ParallelPlan.state_bytes``), with the peak host memory
per rank; a pipeline also its measured bubble (the mean fraction of a step a rank waits in its
receives) beside its schedule's on the clock of ``pipeline_schedule.simulate`` (a backward costing two
forwards). Then the same predictions for Llama-2-7B at dp8, tp8, dp2 x tp4 and
ZeRO 1-3 on 8 ranks, beside the published formulas they should agree with: ZeRO's memory per rank
(Rajbhandari et al. 2020, section 5: 16 bytes per parameter, mixed-precision Adam, divided as the
stage says) and traffic (2 Psi per rank for data parallelism and ZeRO 1-2, 3 Psi for ZeRO 3), and
Megatron-LM's four all-reduces of the [b, s, h] activation per layer and step (Shoeybi et al. 2019,
section 3). On this 2-core machine the ranks share the cores: correctness and bytes are the point,
not speed.

``--eager``: the eager distributed step's overhead. ``llmkit train configs/bench.yaml`` with tp=2
and dp=2 x tp=2 in one process (``sim``: every rank here), each step timed twice in turn: with the
SPMD decisions remembered per (op, attributes, shapes, placements) as shipped (``spmd.decide``),
and decided afresh at every op (``spmd.choose``, the baseline), with the share of the afresh step
spent deciding. Ratios are paired per round (the two measured back to back on this drifting VM).
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
from _common import emit, emit_paired_ratio, machine

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


# ---- training ----------------------------------------------------------------------------------

STRATEGIES = {  # name: (processes, parallel section, extra overrides)
    "dp2": (2, {"dp": 2}, []),
    "tp2": (2, {"tp": 2}, []),
    "tp2_sp": (2, {"tp": 2, "sp": "true"}, []),
    "dp2_tp2": (4, {"dp": 2, "tp": 2}, []),
    "dp2_zero1": (2, {"dp": 2, "zero": 1}, []),
    "dp2_zero2": (2, {"dp": 2, "zero": 2}, []),
    "dp2_zero3": (2, {"dp": 2, "zero": 3}, []),
    "dp2_static": (2, {"dp": 2}, ["train.mode=static"]),
    "dp2_tp2_static": (4, {"dp": 2, "tp": 2}, ["train.mode=static"]),
    "pp2_1f1b": (2, {"pp": 2, "micro_batches": 4, "schedule": "1f1b"}, []),
    "pp2_zero_bubble": (2, {"pp": 2, "micro_batches": 4, "schedule": "zero_bubble"}, []),
    "pp2_1f1b_static": (2, {"pp": 2, "micro_batches": 4, "schedule": "1f1b"}, ["train.mode=static"]),
}
RING = {  # bytes a member sends, from the array it passes (x) and the group size (n)
    "all_reduce": lambda x, n: 2 * (n - 1) / n * x,
    "all_gather": lambda x, n: (n - 1) * x,
    "reduce_scatter": lambda x, n: (n - 1) / n * x,
    "all_to_all": lambda x, n: (n - 1) / n * x,
}


def train_overrides(steps: int, parallel: dict, extra: list[str], out: str) -> list[str]:
    return [
        f"train.steps={steps}",
        "lr_schedule.warmup_steps=1",
        "train.log_every=1",
        f"out_dir={out}",
        *(f"parallel.{k}={v}" for k, v in parallel.items()),
        *extra,
    ]


def train_worker(overrides: list[str], warmup: int) -> None:
    """One rank of ``llmkit train configs/bench.yaml OVERRIDES``: time its steps, count its bytes."""
    import llmkit.framework.distributed as dist
    from llmkit.train.config import load_config
    from llmkit.train.metrics import peak_rss_bytes
    from llmkit.train.trainer import Trainer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trainer = Trainer(load_config(os.path.join(root, "configs", "bench.yaml"), overrides), quiet=True)
    backend = dist.get_backend()
    sent = [0.0]
    for kind, cost in RING.items():
        run = getattr(backend, kind)

        def counted(group, xs, *a, _run=run, _cost=cost, **k):
            for x in xs.values():
                sent[0] += _cost(x.nbytes, len(group))
            return _run(group, xs, *a, **k)

        setattr(backend, kind, counted)
    waited = [0.0]  # seconds in pipeline receives: the rank idles there (the measured bubble)
    send, recv = backend.send, backend.recv

    def counted_send(src, dst, x, *a, **k):
        sent[0] += x.nbytes
        return send(src, dst, x, *a, **k)

    def timed_recv(*a, **k):
        t0 = time.perf_counter()
        try:
            return recv(*a, **k)
        finally:
            waited[0] += time.perf_counter() - t0

    backend.send, backend.recv = counted_send, timed_recv
    times, waits = [], []
    for i in range(trainer.cfg.train.steps):
        before, idle = sent[0], waited[0]
        t0 = time.perf_counter()
        trainer.train_step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            waits.append((waited[0] - idle) / times[-1])
            per_step = sent[0] - before
    me, group = trainer.rank, tuple(range(backend.world_size))
    mine = np.array(
        [np.median(times), per_step, trainer.state_bytes, peak_rss_bytes(), trainer.activation_bytes],
        np.float64,
    )
    wait = np.array([np.median(waits)], np.float64)
    if trainer.backend == "mpi":
        mine = backend.all_reduce(group, {me: mine}, "max")[me]
        wait = backend.all_reduce(group, {me: wait}, "avg")[me]
    if me == 0:
        keys = ("seconds", "sent_bytes", "state_bytes", "peak_rss_bytes", "activation_bytes")
        print(json.dumps({**dict(zip(keys, map(float, mine))), "wait_fraction": float(wait[0])}), flush=True)


def launch_training(n: int, overrides: list[str], warmup: int) -> dict:
    """``llmkit train configs/bench.yaml OVERRIDES`` on ``n`` processes (mpiexec when more than one),
    each rank through :func:`train_worker`: its JSON line (the slowest rank's figures)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--train-worker",
        "--warmup",
        str(warmup),
        "--",
        *overrides,
    ]
    if n > 1:
        cmd = ["mpiexec", "--oversubscribe", "--allow-run-as-root", "-n", str(n), *cmd]
    got = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if got.returncode != 0:
        sys.exit(f"{' '.join(cmd[:6])} ... failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def predictions(parallel: dict, batch_size: int, seq_len: int) -> dict:
    """The plan's traffic per step and state bytes per rank for the bench model; a pipeline: the
    activations and their gradients across the stage boundary ([B, S, H] each way per step; the
    fullest rank sends one of them), and the clock's bubble of its schedule (pipeline_schedule.simulate)."""
    from llmkit.framework import nn
    from llmkit.framework.distributed.parallel_plan import ParallelPlan
    from llmkit.framework.distributed.pipeline_schedule import make_schedule, simulate
    from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
    from llmkit.models.llama.sharding import predict_traffic

    config = LlamaConfig.from_preset("bench")
    if "pp" in parallel:
        sched = make_schedule(parallel["schedule"], parallel["pp"], parallel["micro_batches"])
        boundary = batch_size * seq_len * config.hidden_size * 4
        return {"traffic": {"pp_boundary": boundary}, "state": None, "bubble": simulate(sched).bubble}
    kw = {k: (v == "true" if v in ("true", "false") else v) for k, v in parallel.items()}
    plan = ParallelPlan.make("llama", **kw)
    with nn.init.skip_init():
        shapes = {k: p.shape for k, p in LlamaForCausalLM(config).named_parameters()}
    return {"traffic": predict_traffic(plan, config, batch_size, seq_len), "state": plan.state_bytes(shapes)}


def training(args) -> None:
    import tempfile

    steps = args.steps
    batch, seq = 8, 256  # configs/bench.yaml

    def launch(n: int, parallel: dict, extra: list[str]) -> dict:
        with tempfile.TemporaryDirectory() as out:
            return launch_training(n, train_overrides(steps, parallel, extra, out), args.warmup)

    single = launch(1, {}, [])
    emit("parallel", "train_single_step", single["seconds"], "s", state_bytes=single["state_bytes"],
         peak_rss_mb=round(single["peak_rss_bytes"] / 2**20))  # fmt: skip
    for name, (n, parallel, extra) in STRATEGIES.items():
        if args.strategies and name not in args.strategies:
            continue
        got = launch(n, parallel, extra)
        pred = predictions(parallel, batch, seq)
        traffic = sum(pred["traffic"].values())
        emit(
            "parallel",
            f"train_{name}_step",
            got["seconds"],
            "s",
            ranks=n,
            vs_single=round(got["seconds"] / single["seconds"], 2),
            sent_mb_per_rank=round(got["sent_bytes"] / 2**20, 3),
            predicted_mb_per_rank=round(traffic / 2**20, 3),
            predicted_by_cause_mb={k: round(v / 2**20, 3) for k, v in pred["traffic"].items()},
            traffic_error_pct=round(100 * (got["sent_bytes"] - traffic) / traffic, 1) if traffic else None,
            state_mb_per_rank=round(got["state_bytes"] / 2**20, 3),
            predicted_state_mb=round(pred["state"] / 2**20, 3) if pred["state"] is not None else None,
            idle_in_recv=round(got["wait_fraction"], 3),
            clock_bubble=round(pred["bubble"], 3) if "bubble" in pred else None,
            state_vs_single=round(got["state_bytes"] / single["state_bytes"], 3),
            peak_rss_mb=round(got["peak_rss_bytes"] / 2**20),
        )
    llama7b()


def eager_overhead(args) -> None:
    """The eager step on sim with decisions remembered against decided afresh (see the docstring)."""
    import tempfile

    import llmkit.framework.distributed.world as world
    from llmkit.framework.ops import spmd
    from llmkit.train.config import load_config
    from llmkit.train.trainer import Trainer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    deciding = [0.0]

    def afresh(*a, **k):
        t0 = time.perf_counter()
        try:
            return spmd.choose(*a, **k)
        finally:
            deciding[0] += time.perf_counter() - t0

    for name in args.strategies or ("tp2", "dp2_tp2"):
        _, parallel, extra = STRATEGIES[name]
        with tempfile.TemporaryDirectory() as out:
            ov = train_overrides(args.steps + 1, parallel, extra, out)
            trainer = Trainer(load_config(os.path.join(root, "configs", "bench.yaml"), ov), quiet=True)
            trainer.train_step()  # warm-up: the decisions of every op made once
            remembered, fresh, shares = [], [], []
            for _ in range(args.steps):
                for decide, times in ((afresh, fresh), (spmd.decide, remembered)):
                    world.decide, deciding[0] = decide, 0.0
                    t0 = time.perf_counter()
                    trainer.train_step()
                    times.append(time.perf_counter() - t0)
                shares.append(deciding[0] / fresh[-1])
            world.decide = spmd.decide
        emit_paired_ratio(
            "parallel",
            f"eager_step_{name}_sim_remembered_vs_afresh",
            remembered,
            fresh,
            remembered_s=round(float(np.median(remembered)), 3),
            afresh_s=round(float(np.median(fresh)), 3),
            deciding_share_afresh=round(float(np.median(shares)), 3),
            decisions_kept=len(spmd._DECISIONS),
        )


def llama7b() -> None:
    """Predicted bytes and memory for Llama-2-7B beside the published formulas (see the docstring)."""
    from llmkit.framework import nn
    from llmkit.framework.distributed.parallel_plan import ParallelPlan
    from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
    from llmkit.models.llama.sharding import predict_traffic

    config = LlamaConfig.from_preset("7B")
    with nn.init.skip_init():  # shapes only: no weight is drawn or touched
        shapes = {k: p.shape for k, p in LlamaForCausalLM(config).named_parameters()}
    psi = sum(int(np.prod(s)) for s in shapes.values())
    seq, gb = 4096, 2**30
    for name, kw in {
        "dp8": {"dp": 8},
        "tp8": {"tp": 8},
        "dp2_tp4": {"dp": 2, "tp": 4},
        "dp8_zero1": {"dp": 8, "zero": 1},
        "dp8_zero2": {"dp": 8, "zero": 2},
        "dp8_zero3": {"dp": 8, "zero": 3},
    }.items():
        plan = ParallelPlan.make("llama", **kw)
        dp, tp, z = plan.size("dp"), plan.size("tp"), plan.zero
        traffic = predict_traffic(plan, config, dp, seq)  # one 4096-token sequence per dp rank
        # ZeRO (section 5): 2 + 2 + 12 bytes per parameter (fp16 weights and gradients, fp32 Adam
        # state and master weights), the state / gradients / weights divided by dp from stages 1/2/3
        zero_paper = (
            psi / tp * (2 / (dp if z >= 3 else 1) + 2 / (dp if z >= 2 else 1) + 12 / (dp if z >= 1 else 1))
        )
        # published traffic per rank per step, in this run's 4-byte elements: ZeRO 2 Psi (3 Psi at
        # stage 3) for the data-parallel part; Megatron 4 all-reduces of [b, s, h] per layer
        psi_dp = psi / tp * (dp - 1) / dp
        published = (3 if z >= 3 else 2) * psi_dp * 4 if dp > 1 else 0.0
        if tp > 1:
            published += 4 * config.num_hidden_layers * 2 * (tp - 1) / tp * seq * config.hidden_size * 4
        emit(
            "parallel",
            f"llama2_7b_{name}",
            plan.state_bytes(shapes) / gb,
            "GB/rank",
            note="parameters + gradients + 2 AdamW moments, float32",
            zero_paper_gb=round(zero_paper / gb, 2),
            predicted_traffic_gb_per_step=round(sum(traffic.values()) / gb, 3),
            published_traffic_gb_per_step=round(published / gb, 3),
            by_cause_gb={k: round(v / gb, 3) for k, v in traffic.items()},
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 1 << 10, 1 << 16, 1 << 20, 1 << 23])
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--training", action="store_true", help="parallel training instead of collectives")
    p.add_argument(
        "--eager", action="store_true", help="the eager distributed step's decision overhead (sim)"
    )
    p.add_argument(
        "--strategies", nargs="*", help=f"with --training or --eager: some of {', '.join(STRATEGIES)}"
    )
    p.add_argument(
        "--steps", type=int, default=5, help="with --training: steps per run (the first timed after --warmup)"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--train-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.train_worker:
        train_worker(args.overrides, args.warmup)
        return
    if args.worker:
        worker(args.sizes, args.repeat)
        return
    if args.eager:
        emit("parallel", "machine", 0, "", **machine())
        eager_overhead(args)
        return
    if args.training:
        if shutil.which("mpiexec") is None:
            sys.exit("benchmarks/parallel.py --training needs mpiexec (pip install -e '.[dist]')")
        emit("parallel", "machine", 0, "", **machine())
        training(args)
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
