"""The planner: every dp x tp x pp x ZeRO x recompute x micro-batch plan of a world, its predicted
step time and peak memory per rank, and the fastest plan that fits, with the reasons.

The model is described by a :class:`ModelCost` (the model package writes it; the framework knows no
model): per decoder layer its parameters, forward FLOPs and the activation bytes it keeps per token
under each recompute policy; the same for the embedding and the head. The machine is a
:class:`Machine`: matmul FLOP/s, memory bandwidth, and per link (inside a node, across nodes) an
alpha (seconds per message) and a beta (seconds per byte) for ring collectives. For one micro-batch
of ``b`` sequences of ``S`` tokens on one rank holding ``L/pp`` layers cut ``tp`` ways:

    forward  t_F = flops / (tp F) + 3 act / (tp W) + 2 (L/pp) t_allreduce(tp, b S h)
    backward t_B = 2 t_F + (recompute: the recomputed part's forward again)
    step     = clock(schedule, pp, m; t_F, t_B) + 2 (pp - 1) t_p2p + t_dp(ZeRO) + t_update

``clock`` is :func:`pipeline_schedule.simulate` on the schedule's job lists (the bubble), ``t_dp`` the data
parallel gradient reduction and ZeRO's gathers (no overlap with compute: llmkit's runtime has none),
``t_update`` the optimizer's pass over the rank's state (at memory bandwidth, or a measured rate).
Peak memory per rank is

    params + grads + optimizer state (each divided over dp by the ZeRO stage, over tp and pp)
    + in-flight micro-batches (the schedule's peak) x activations of one micro-batch

The ZeRO divisions are Rajbhandari et al. 2020 (section 5): stage 1 shards the optimizer state,
2 also the gradients, 3 also the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache

from .parallel_plan import RECOMPUTE, ZERO_STAGES, PlanError
from .pipeline_schedule import SCHEDULES, Schedule, simulate

GB = 1e9


@dataclass(frozen=True)
class ModelCost:
    """What the planner needs of a model, per token of ``seq_len``-long sequences."""

    name: str
    layers: int
    hidden: int  # the activation passed between layers and stages, per token: hidden * act_itemsize
    layer_params: int  # parameters of one decoder layer
    edge_params: tuple[int, int]  # (embedding, head) parameters: the first and last stage's extra
    layer_flops: float  # forward FLOPs per token of one layer (2 per multiply-add)
    edge_flops: tuple[float, float]  # forward FLOPs per token of the embedding and the head
    # recompute policy -> activation bytes a layer keeps per token: (replicated over tp, cut by tp)
    layer_act: Mapping[str, tuple[float, float]]
    edge_act: tuple[tuple[float, float], tuple[float, float]]  # the embedding's and the head's, alike
    recompute_flops: Mapping[str, float]  # policy -> forward FLOPs per token a recomputed layer reruns
    seq_len: int
    act_itemsize: int = 4
    heads: int = 1  # tp must divide it (whole heads per rank)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + sum(self.edge_params)

    def train_flops(self, tokens: int) -> float:
        """Model FLOPs of a step (forward + backward, no recompute): the MFU numerator."""
        return 3 * tokens * (self.layers * self.layer_flops + sum(self.edge_flops))


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter: weights, gradients, optimizer state (AdamW: two moments, and a master
    copy when weights are half precision)."""

    weight: int = 4
    grad: int = 4
    state: int = 8

    @property
    def total(self) -> int:
        return self.weight + self.grad + self.state


FP32 = Precision()  # llmkit's float32 training: weights, gradients and two float32 moments
MIXED = Precision(2, 2, 12)  # ZeRO's mixed precision: fp16 weights and gradients, fp32 master + moments


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per ring step (latency)
    beta: float  # seconds per byte sent by a rank


@dataclass(frozen=True)
class Machine:
    """Speeds of one rank and of the links between ranks (``node`` ranks share the fast link)."""

    name: str
    flops: float  # matmul FLOP/s a rank reaches
    bandwidth: float  # memory bytes/s of a rank (elementwise ops, the optimizer)
    intra: Link
    inter: Link
    node: int  # ranks per node
    peak_flops: float | None = None  # the published peak (MFU's denominator); None: flops
    whole_step: bool = False  # flops was measured on the model's whole forward + backward (its
    # elementwise ops included), not on a bare matmul: no separate elementwise term
    update_rate: float | None = None  # parameters the optimizer step (with clipping) updates per
    # second, measured; None: its state read and written once at memory bandwidth

    def link(self, ranks: int, stride: int = 1) -> Link:
        """The slowest link of a group of ``ranks`` ranks ``stride`` apart."""
        return self.intra if ranks * stride <= self.node else self.inter

    def ring(self, kind: str, ranks: int, nbytes: float, stride: int = 1) -> float:
        """Seconds of a ring all_reduce / all_gather / reduce_scatter of ``nbytes`` (the whole)."""
        if ranks == 1:
            return 0.0
        link = self.link(ranks, stride)
        factor = 2 if kind == "all_reduce" else 1
        return factor * (ranks - 1) * (link.alpha + link.beta * nbytes / ranks)


# Published dense bf16 peaks and memory bandwidths (vendors' datasheets: A100 SXM 80GB, H100 SXM,
# H200 SXM), NVLink per direction inside a node of 8, one 200/400 Gb/s NIC per GPU across nodes.
# EFFICIENCY is the matmul share of peak a well-tuned trainer reaches (MFU-style: Megatron-LM
# reports 0.4-0.55 MFU end to end; the matmuls themselves run at about 0.7 of peak).
EFFICIENCY = 0.7
GPUS: dict[str, dict[str, float]] = {
    "A100": {"peak": 312e12, "memory": 2.0e12, "nvlink": 300e9, "net": 25e9},
    "H100": {"peak": 989e12, "memory": 3.35e12, "nvlink": 450e9, "net": 50e9},
    "H200": {"peak": 989e12, "memory": 4.8e12, "nvlink": 450e9, "net": 50e9},
}


def gpu_machine(name: str) -> Machine:
    g = GPUS.get(name.upper())
    if g is None:
        raise PlanError("gpu", f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return Machine(
        name,
        g["peak"] * EFFICIENCY,
        g["memory"],
        Link(5e-6, 1 / g["nvlink"]),
        Link(10e-6, 1 / g["net"]),
        node=8,
        peak_flops=g["peak"],
    )


@dataclass(frozen=True)
class Candidate:
    """One plan and its predictions (seconds, bytes per rank)."""

    dp: int
    tp: int
    pp: int
    zero: int
    recompute: str
    micro_batches: int
    schedule: str
    memory: float  # peak bytes of the fullest rank
    step: float  # seconds
    parts: Mapping[str, float] = field(default_factory=dict)  # compute, bubble, tp, pp, dp, update

    @property
    def label(self) -> str:
        bits = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        bits += [f"zero{self.zero}"] if self.zero else []
        bits += [f"rc-{self.recompute}"] if self.recompute != "none" else []
        bits += [f"m{self.micro_batches}"] + ([self.schedule] if self.pp > 1 else [])
        return " ".join(bits)

    def simplicity(self) -> tuple:
        """Among equal times, the plainer plan: fewer ranks split, no ZeRO, recompute or micro-batches."""
        return (self.pp, self.tp, self.zero, list(RECOMPUTE).index(self.recompute), self.micro_batches)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=1024)
def _schedule(name: str, pp: int, m: int) -> Schedule:
    """The job lists (built as ``make_schedule`` builds them; its check is the schedule tests')."""
    return Schedule(name, pp, m, 1, tuple(tuple(js) for js in SCHEDULES[name](pp, m, 1)))


@lru_cache(maxsize=1024)
def _in_flight(name: str, pp: int, m: int) -> int:
    return _schedule(name, pp, m).peak_in_flight()


@lru_cache(maxsize=4096)
def _clock(name: str, pp: int, m: int, b_over_f: float) -> float:
    """Makespan in forward-times of ``name``'s job lists (F = 1, B = ``b_over_f``, no hop latency;
    a split backward's B and W take half of it each)."""
    split = name == "zero_bubble"
    costs = {"F": 1.0, "B": b_over_f / 2 if split else b_over_f, "W": b_over_f / 2 if split else 0.0}
    return simulate(_schedule(name, pp, m), costs).makespan


def estimate(
    cost: ModelCost,
    machine: Machine,
    batch: int,
    dp: int,
    tp: int,
    pp: int,
    zero: int,
    recompute: str,
    micro_batches: int,
    schedule: str = "1f1b",
    precision: Precision = FP32,
) -> Candidate:
    """Predicted step time and peak memory per rank of one plan (see the module docstring);
    ``batch`` sequences per step over the whole job."""
    s, h, L = cost.seq_len, cost.hidden, cost.layers
    m = micro_batches
    tokens = batch // (dp * m) * s  # per micro-batch on one rank
    layers = math.ceil(L / pp)  # the fullest stage's layers
    edges = 2 if pp == 1 else 1  # the embedding and head on one stage only without a pipeline
    edge_p = max(cost.edge_params) if pp > 1 else sum(cost.edge_params)
    edge_f = max(cost.edge_flops) if pp > 1 else sum(cost.edge_flops)
    cut = lambda a: a[0] + a[1] / tp  # (replicated, sharded) bytes -> one tp rank's
    edge_a = max(map(cut, cost.edge_act)) if pp > 1 else sum(map(cut, cost.edge_act))
    params = (layers * cost.layer_params + edge_p) / tp
    # ---- memory: state divided by ZeRO over dp, activations of the in-flight micro-batches
    on_dp = lambda stage: dp if zero >= stage else 1
    state = params * (precision.weight / on_dp(3) + precision.grad / on_dp(2) + precision.state / on_dp(1))
    in_flight = 1 if pp == 1 else _in_flight(schedule, pp, m)  # without a pipeline: one at a time
    act = tokens * (layers * cut(cost.layer_act[recompute]) + edge_a)
    memory = state + in_flight * act
    # ---- time per micro-batch on the fullest stage: the layers', then the edges'
    stream = tokens * h * cost.act_itemsize
    ring = machine.ring("all_reduce", tp, stream)

    def forward(flops: float, act_none: float, all_reduces: int) -> float:
        # every activation is written in the forward (whatever recompute keeps), unless the
        # measured speed already includes the elementwise ops
        memory_time = 0.0 if machine.whole_step else tokens * act_none / machine.bandwidth
        return tokens * flops / tp / machine.flops + memory_time + all_reduces * ring

    # Megatron's two all-reduces per layer (attention, MLP), one per edge (embedding, head)
    t_layers = forward(layers * cost.layer_flops, layers * cut(cost.layer_act["none"]), 2 * layers)
    t_f = t_layers + forward(edge_f, edge_a, edges)
    t_tp = (2 * layers + edges) * ring
    # a backward is two forwards, plus the forward of what the policy recomputes
    t_b = 2 * t_f + t_layers * cost.recompute_flops[recompute] / cost.layer_flops
    if pp == 1:
        compute, bubble = m * (t_f + t_b), 0.0
    else:
        # the bubble's share from the clock at B/F rounded to a quarter (a few clocks serve every plan)
        ratio = round(t_b / t_f * 4) / 4
        span = m * (t_f + t_b) * _clock(schedule, pp, m, ratio) / (m * (1 + ratio))
        compute, bubble = m * (t_f + t_b), span - m * (t_f + t_b)
    hop = machine.inter if tp * pp > machine.node else machine.intra
    t_pp = 2 * (pp - 1) * (hop.alpha + hop.beta * stream) if pp > 1 else 0.0
    # ---- data parallel: gradients reduced, ZeRO's gathers (stride tp * pp: dp is the outer dim)
    grads = params * precision.grad
    weights = params * precision.weight
    stride = tp * pp
    if zero >= 2:
        # ZeRO 3: each layer gathers its own weights in the forward, one ring per layer
        gathers = layers if zero == 3 else 1
        t_dp = machine.ring("reduce_scatter", dp, grads, stride)
        t_dp += gathers * machine.ring("all_gather", dp, weights / gathers, stride)
    else:
        t_dp = machine.ring("all_reduce", dp, grads, stride)
        t_dp += machine.ring("all_gather", dp, weights, stride) if zero == 1 else 0.0
    if machine.update_rate:  # each rank updates its ZeRO shard of the parameters
        t_update = params / on_dp(1) / machine.update_rate
    else:
        t_update = 2 * state / machine.bandwidth  # read and write every state byte once
    parts = {"compute": compute, "bubble": bubble, "tp": 3 * m * t_tp, "pp": t_pp, "dp": t_dp}
    parts["update"] = t_update
    step = compute + bubble + t_pp + t_dp + t_update
    return Candidate(dp, tp, pp, zero, recompute, m, schedule, memory, step, parts)


def candidates(
    cost: ModelCost,
    machine: Machine,
    world: int,
    batch: int,
    *,
    precision: Precision = FP32,
    schedules: Iterable[str] = ("1f1b",),
    max_pp: int | None = None,
    max_micro: int = 64,
) -> list[Candidate]:
    """Every valid plan of ``world`` ranks: dp x tp x pp = world, tp dividing the heads and at most
    a node, pp at most the layers, dp dividing the batch, micro-batches dividing each dp rank's rows
    (powers of two, at least pp with a pipeline), ZeRO stages only with dp > 1."""
    out = []
    max_pp = cost.layers if max_pp is None else min(max_pp, cost.layers)
    for tp in divisors(world):
        if cost.heads % tp or tp > machine.node:
            continue
        for pp in divisors(world // tp):
            dp = world // tp // pp
            if pp > max_pp or batch % dp:
                continue
            rows = batch // dp
            # powers of two; a pipeline takes pp to 4 pp of them (more only shrinks a bubble already small)
            micro = [
                d
                for d in divisors(rows)
                if d & (d - 1) == 0 and d <= max_micro and (pp == 1 or pp <= d <= 4 * pp)
            ]
            for m in micro:
                # zero_bubble's list scheduler is quadratic in the jobs: left out of long pipelines
                names = [n for n in schedules if n != "zero_bubble" or pp * m <= 512] if pp > 1 else ["1f1b"]
                for name in names:
                    for zero in ZERO_STAGES if dp > 1 else (0,):
                        for rc in RECOMPUTE:
                            out.append(
                                estimate(cost, machine, batch, dp, tp, pp, zero, rc, m, name, precision)
                            )
    return out


@dataclass
class Choice:
    best: Candidate
    ranked: list[Candidate]  # the fitting candidates, fastest first
    unfit: list[Candidate]
    mem: float

    def reasons(self) -> list[str]:
        b = self.best
        lines = [f"chose {b.label}: {b.step:.4g} s per step, {b.memory / GB:.3g} GB per rank"]
        if len(self.ranked) > 1:
            r = self.ranked[1]
            if r.step <= b.step * (1 + 1e-9):
                lines.append(
                    f"as fast as the runner-up {r.label}, and plainer (fewer pipeline stages, tp ranks, "
                    "ZeRO stage, recompute, micro-batches: in that order)"
                )
            else:
                worse = max(b.parts, key=lambda k: r.parts.get(k, 0) - b.parts.get(k, 0))
                lines.append(
                    f"beats the runner-up {r.label} by {100 * (r.step / b.step - 1):.2g}% "
                    f"(its {worse} takes {r.parts[worse]:.3g} s, this one's {b.parts[worse]:.3g} s)"
                )
        faster = [c for c in self.unfit if c.step < b.step]
        if faster:
            f = min(faster, key=lambda c: c.step)
            lines.append(
                f"{len(faster)} faster plans do not fit in {self.mem / GB:.3g} GB: the fastest, {f.label}, "
                f"needs {f.memory / GB:.3g} GB ({f.step:.4g} s)"
            )
        elif self.unfit:
            lines.append(
                f"{len(self.unfit)} plans do not fit in {self.mem / GB:.3g} GB (none of them faster)"
            )
        return lines


def choose(pool: list[Candidate], mem: float) -> Choice:
    """The fastest candidate whose peak memory fits ``mem`` bytes (the plainer among equals);
    PlanError naming the smallest memory needed when none fits."""
    if not pool:
        raise PlanError(
            "",
            "no plan: no dp x tp x pp layout of the world fits the model and batch (dp divides the "
            "batch, tp the attention heads, pp is at most the layers, and a pipeline needs at least pp "
            "micro-batches of a data-parallel rank's rows)",
        )
    fit = sorted((c for c in pool if c.memory <= mem), key=lambda c: (float(f"{c.step:.9g}"), c.simplicity()))
    unfit = [c for c in pool if c.memory > mem]
    if not fit:
        small = min(pool, key=lambda c: c.memory)
        raise PlanError(
            "",
            f"no plan fits in {mem / GB:.3g} GB per rank: the smallest, {small.label}, needs "
            f"{small.memory / GB:.3g} GB per rank (more ranks, a smaller batch or sequence, or more memory)",
        )
    return Choice(fit[0], fit, unfit, mem)


def table(choice: Choice, cost: ModelCost, machine: Machine, batch: int, top: int = 10) -> str:
    """The candidates that fit, fastest first (``top`` of them), with the counts."""
    head = f"{'plan':<44} {'step s':>9} {'GB/rank':>8} {'compute':>8} {'bubble':>7} {'comm':>8} {'MFU':>6}"
    rows = [head]
    for c in choice.ranked[:top]:
        comm = c.parts["tp"] + c.parts["pp"] + c.parts["dp"]
        rows.append(
            f"{c.label:<44} {c.step:>9.4g} {c.memory / GB:>8.3g} {c.parts['compute']:>8.3g} "
            f"{c.parts['bubble']:>7.3g} {comm:>8.3g} {mfu(c, cost, machine, batch):>6.1%}"
        )
    n, u = len(choice.ranked), len(choice.unfit)
    rows.append(f"({n} plans fit, {u} do not, {n + u} in all; showing {min(top, n)})")
    return "\n".join(rows)


def mfu(c: Candidate, cost: ModelCost, machine: Machine, batch: int) -> float:
    """Model FLOPs per second over the world's peak (the published peak on a GPU)."""
    peak = machine.peak_flops or machine.flops
    return cost.train_flops(batch * cost.seq_len) / c.step / (peak * c.dp * c.tp * c.pp)


def plan(cost: ModelCost, machine: Machine, world: int, batch: int, mem: float, **kw) -> Choice:
    return choose(candidates(cost, machine, world, batch, **kw), mem)


def scaled(machine: Machine, ranks_per_host: int, cores: int) -> Machine:
    """This host's machine for ranks sharing its cores: each rank gets its share of the speeds a
    probe measured with every core (the FLOP/s, memory bandwidth and optimizer rate)."""
    ranks = max(ranks_per_host, 1)
    share = max(cores // ranks, 1) / cores if ranks <= cores else 1 / ranks
    speeds = ("flops", "bandwidth", "update_rate", "peak_flops")
    return replace(machine, **{k: getattr(machine, k) and getattr(machine, k) * share for k in speeds})
