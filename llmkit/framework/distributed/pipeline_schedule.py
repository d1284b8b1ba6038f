"""Pipeline schedules as explicit job lists: for each pipeline rank, the order of its jobs.

A model cut into ``S = pp * v`` consecutive *stages* runs them on ``pp`` ranks, rank ``s % pp``
holding stage ``s`` (``v`` stages per rank: "virtual stages", Megatron's interleaving; ``v = 1``
is the plain pipeline). A step's batch is cut into ``m`` micro-batches, and a *job* is one stage's
work on one micro-batch:

- ``F``: the forward (its input comes from stage ``s - 1``; its output goes to ``s + 1``);
- ``B``: the backward (its output gradient comes from ``s + 1``; its input gradient goes to
  ``s - 1``); in a schedule that also lists ``W`` jobs, ``B`` computes the input gradient only;
- ``W``: the weight gradient (zero-bubble schedules), needing only its own ``B``.

Every schedule is a table entry building the job lists (:data:`SCHEDULES`):

==============  =======================================================================  ============
name            order on rank ``r``                                                       in flight
==============  =======================================================================  ============
``fthenb``      every forward, then every backward (GPipe)                                ``m``
``1f1b``        ``pp - r - 1`` forwards, then one forward and one backward in turn         ``pp - r``
                (PipeDream-flush: Narayanan et al. 2021, "Efficient large-scale
                language model training on GPU clusters using Megatron-LM", figure 4)
``interleaved`` 1F1B over ``v`` stages per rank, forwards in groups of ``pp``             ``2(pp-r-1)
                micro-batches per chunk (the same paper, section 2.2); ``m`` a            + (v-1)pp + 1``
                multiple of ``pp``                                                        chunks of 1/v
``zero_bubble`` each backward split into B (input gradient) then W (weight gradient),    ``pp``
                list-scheduled on the clock by ZB-H1's rules (Qi et al. 2024, "Zero
                bubble pipeline parallelism"): a free rank runs a ready B first, else
                its next F while it holds fewer than ``pp`` micro-batches, else a
                pending W (W jobs fill the bubbles)
==============  =======================================================================  ============

"In flight" is the peak number of micro-batches whose activations a rank holds (forward done,
last backward job not yet): the memory a schedule costs. :func:`simulate` runs the job lists on
a clock (a cost per job kind, a latency per hop between ranks) and gives each job's start, the
step time and the bubble, which the planner uses; ``Schedule.check()`` verifies that the lists
are a valid, deadlock-free schedule.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


class ScheduleError(ValueError):
    """A schedule that cannot be built or does not hold (the message names the job and rank)."""


@dataclass(frozen=True, order=True)
class Job:
    """``kind`` ("F", "B", "W") of virtual ``stage`` on micro-batch ``micro``."""

    kind: str
    stage: int
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro} of stage {self.stage}"

    def label(self, pp: int, virtual: int) -> str:
        """``F3`` (micro-batch 3); with virtual stages ``F3.1`` (micro-batch 3 on the rank's chunk 1)."""
        return f"{self.kind}{self.micro}" + (f".{self.stage // pp}" if virtual > 1 else "")


@dataclass(frozen=True)
class Schedule:
    """The job list of every pipeline rank (``jobs[r]``, in the order rank ``r`` runs them)."""

    name: str
    pp: int
    micro_batches: int
    virtual: int
    jobs: tuple[tuple[Job, ...], ...]

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    @property
    def split_backward(self) -> bool:
        """Whether backward jobs compute input gradients only (weight gradients are W jobs)."""
        return any(j.kind == "W" for rank in self.jobs for j in rank)

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def last_job(self) -> str:
        """The kind of job after which a micro-batch's activations on a stage are released."""
        return "W" if self.split_backward else "B"

    def __str__(self) -> str:
        head = f"{self.name}: {self.pp} ranks x {self.micro_batches} micro-batches"
        if self.virtual > 1:
            head += f", {self.virtual} stages per rank (F3.1: micro-batch 3 on the rank's chunk 1)"
        width = len(str(self.pp - 1))
        rows = [
            f"rank {r:>{width}}: " + " ".join(j.label(self.pp, self.virtual) for j in jobs)
            for r, jobs in enumerate(self.jobs)
        ]
        return "\n".join([head, *rows])

    # ---- memory -----------------------------------------------------------------------------------
    def in_flight(self, rank: int) -> int:
        """Peak number of (stage, micro-batch) activations rank ``rank`` holds at once."""
        last = self.last_job()
        held = peak = 0
        for j in self.jobs[rank]:
            if j.kind == "F":
                held += 1
                peak = max(peak, held)
            elif j.kind == last:
                held -= 1
        return peak

    def peak_in_flight(self) -> int:
        return max(self.in_flight(r) for r in range(self.pp))

    # ---- validity ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Each job once, on its stage's rank, F before B (before W) of the same micro-batch, and
        a clock run of the lists finishes (no rank waits forever)."""
        kinds = ("F", "B", "W") if self.split_backward else ("F", "B")
        want = {Job(k, s, m) for k in kinds for s in range(self.stages) for m in range(self.micro_batches)}
        seen: set[Job] = set()
        for r, jobs in enumerate(self.jobs):
            for j in jobs:
                if j in seen:
                    raise ScheduleError(f"{self.name}: rank {r} runs {j} twice")
                if j not in want:
                    raise ScheduleError(f"{self.name}: rank {r} has {j}, which is not a job of this pipeline")
                if self.rank_of(j.stage) != r:
                    raise ScheduleError(
                        f"{self.name}: {j} is on rank {r}, its stage lives on rank {j.stage % self.pp}"
                    )
                for dep in deps(j, self.stages):
                    if dep.stage == j.stage and dep not in seen:
                        raise ScheduleError(f"{self.name}: rank {r} runs {j} before {dep}")
                seen.add(j)
        if seen != want:
            missing = sorted(want - seen)
            raise ScheduleError(
                f"{self.name}: no rank runs {missing[:4]}{' ...' if len(missing) > 4 else ''}"
            )
        simulate(self)


def deps(j: Job, stages: int) -> tuple[Job, ...]:
    """Every job ``j`` needs first: its own stage's, and its neighbour stage's message."""
    if j.kind == "F":
        return (Job("F", j.stage - 1, j.micro),) if j.stage > 0 else ()
    if j.kind == "B":
        after = (Job("B", j.stage + 1, j.micro),) if j.stage < stages - 1 else ()
        return (Job("F", j.stage, j.micro), *after)
    return (Job("B", j.stage, j.micro),)


# ---- the clock ------------------------------------------------------------------------------------

Costs = Mapping[str, float]
UNIT: Costs = {"F": 1.0, "B": 2.0, "W": 0.0}  # a backward is about two forwards
UNIT_SPLIT: Costs = {"F": 1.0, "B": 1.0, "W": 1.0}  # ... half of it input, half weight gradients


@dataclass
class Timeline:
    """Each job's (start, end) on the clock of :func:`simulate`."""

    schedule: Schedule
    times: dict[Job, tuple[float, float]] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max((e for _, e in self.times.values()), default=0.0)

    @property
    def bubble(self) -> float:
        """The idle fraction of the ranks' time between the step's start and its end."""
        busy = sum(e - s for s, e in self.times.values())
        total = self.makespan * self.schedule.pp
        return 1.0 - busy / total if total else 0.0

    def render(self, scale: float = 1.0) -> str:
        """One row per rank, one column per ``scale`` time units: ``F``/``B``/``W`` and the
        micro-batch's last digit where a job runs, ``.`` where the rank waits."""
        rows = []
        col = lambda t: round(t / scale)
        for r in range(self.schedule.pp):
            row = ["."] * col(self.makespan)
            for j in self.schedule.jobs[r]:
                s, e = self.times[j]
                for c in range(col(s), col(e)):
                    row[c] = j.kind if c == col(s) else str(j.micro % 10)
            rows.append(f"rank {r}: " + "".join(row))
        return "\n".join(rows)


def simulate(
    schedule: Schedule, costs: Costs | None = None, hop: float = 0.0, stage_cost: Callable | None = None
) -> Timeline:
    """Run the job lists on a clock: a job starts when its rank is free and its inputs have
    arrived (``hop`` after the neighbour's job ended, when that job is on another rank).

    ``costs``: time per job kind (default :data:`UNIT`, or :data:`UNIT_SPLIT` for schedules with W
    jobs); ``stage_cost(job)``, when given, overrides it per job (stages of unequal cost).
    Raises ScheduleError naming the waiting jobs if the lists cannot finish (a deadlock).
    """
    costs = costs or (UNIT_SPLIT if schedule.split_backward else UNIT)
    cost = stage_cost or (lambda j: costs[j.kind])
    tl = Timeline(schedule)
    pos = [0] * schedule.pp
    free = [0.0] * schedule.pp
    remaining = sum(len(js) for js in schedule.jobs)
    while remaining:
        progressed = False
        for r, jobs in enumerate(schedule.jobs):
            while pos[r] < len(jobs):
                j = jobs[pos[r]]
                ready = free[r]
                for d in deps(j, schedule.stages):
                    if d not in tl.times:
                        break
                    ready = max(ready, tl.times[d][1] + (hop if schedule.rank_of(d.stage) != r else 0.0))
                else:
                    tl.times[j] = (ready, ready + cost(j))
                    free[r] = ready + cost(j)
                    pos[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            stuck = [schedule.jobs[r][pos[r]] for r in range(schedule.pp) if pos[r] < len(schedule.jobs[r])]
            raise ScheduleError(f"{schedule.name}: deadlock, the ranks wait at {', '.join(map(str, stuck))}")
    return tl


# ---- the schedules ----------------------------------------------------------------------------------


def fthenb(pp: int, m: int, v: int) -> list[list[Job]]:
    return [[Job("F", r, i) for i in range(m)] + [Job("B", r, i) for i in range(m)] for r in range(pp)]


def alternate(warmup: int, total: int, job: Callable[[str, int], Job]) -> list[Job]:
    """``warmup`` forwards, then a forward and a backward in turn, then the backwards left: the
    shape of every 1F1B rank (``job("F", k)``, ``job("B", k)``: a rank's k-th forward and backward)."""
    jobs = [job("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        jobs += [job("F", warmup + k), job("B", k)]
    return jobs + [job("B", k) for k in range(total - warmup, total)]


def one_f_one_b(pp: int, m: int, v: int) -> list[list[Job]]:
    return [alternate(min(pp - r - 1, m), m, lambda kind, i, r=r: Job(kind, r, i)) for r in range(pp)]


def interleaved(pp: int, m: int, v: int) -> list[list[Job]]:
    """Megatron's interleaved 1F1B: forward number k on a rank runs chunk ``(k // pp) % v`` on
    micro-batch ``(k // (pp v)) pp + k % pp``; backwards walk the chunks in reverse."""
    if v < 2:
        raise ScheduleError("interleaved: needs virtual_stages >= 2 (with 1 it is 1f1b)")
    if m % pp:
        raise ScheduleError(f"interleaved: micro_batches ({m}) must be a multiple of pp ({pp})")
    total = m * v

    def job(kind: str, r: int, k: int) -> Job:
        chunk = (k // pp) % v
        if kind == "B":
            chunk = v - 1 - chunk
        return Job(kind, chunk * pp + r, (k // (pp * v)) * pp + k % pp)

    warmup = [min((pp - r - 1) * 2 + (v - 1) * pp, total) for r in range(pp)]
    return [alternate(warmup[r], total, lambda kind, k, r=r: job(kind, r, k)) for r in range(pp)]


def zero_bubble(pp: int, m: int, v: int, costs: Costs = UNIT_SPLIT) -> list[list[Job]]:
    """ZB-H1's rules by list scheduling on the clock: a free rank runs the first ready B, else its
    next F while it holds fewer than ``pp`` micro-batches (the peak of 1F1B), else its oldest
    pending W. With unit costs the step takes at most two job-times more than the paper's
    ``3m + (pp - 1)(T_F + T_B - T_W)`` (exactly that when ``m <= pp``); 1F1B takes ``3(m + pp - 1)``."""
    if v != 1:
        raise ScheduleError("zero_bubble: one stage per rank (virtual_stages: 1)")
    done: dict[Job, float] = {}
    free = [0.0] * pp
    next_f = [0] * pp
    pending_b: list[list[int]] = [[] for _ in range(pp)]  # forwards done, backward not yet
    pending_w: list[list[int]] = [[] for _ in range(pp)]
    held = [0] * pp
    out: list[list[Job]] = [[] for _ in range(pp)]
    events: list[float] = [0.0]

    def ready_at(j: Job) -> float | None:
        t = 0.0
        for d in deps(j, pp):
            if d not in done:
                return None
            t = max(t, done[d])
        return t

    total = 3 * pp * m
    while sum(map(len, out)) < total:
        now = heapq.heappop(events)
        for r in range(pp):
            while free[r] <= now:
                pick = None
                for i in sorted(pending_b[r]):
                    t = ready_at(Job("B", r, i))
                    if t is not None and t <= now:
                        pick = Job("B", r, i)
                        break
                if pick is None and next_f[r] < m and held[r] < pp:
                    t = ready_at(Job("F", r, next_f[r]))
                    if t is not None and t <= now:
                        pick = Job("F", r, next_f[r])
                if pick is None and pending_w[r]:
                    pick = Job("W", r, pending_w[r][0])
                if pick is None:
                    break
                start = max(now, free[r])
                free[r] = done[pick] = start + costs[pick.kind]
                heapq.heappush(events, free[r])
                out[r].append(pick)
                if pick.kind == "F":
                    next_f[r] += 1
                    held[r] += 1
                    pending_b[r].append(pick.micro)
                elif pick.kind == "B":
                    pending_b[r].remove(pick.micro)
                    pending_w[r].append(pick.micro)
                else:
                    pending_w[r].pop(0)
                    held[r] -= 1
        if not events and sum(map(len, out)) < total:
            raise ScheduleError("zero_bubble: the list scheduler stalled")  # a bug guard
    return out


SCHEDULES: dict[str, Callable[[int, int, int], list[list[Job]]]] = {
    "fthenb": fthenb,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zero_bubble": zero_bubble,
}


def make_schedule(name: str, pp: int, micro_batches: int, virtual: int = 1) -> Schedule:
    """The ``name`` schedule (a key of :data:`SCHEDULES`) of ``pp`` ranks, ``micro_batches``
    micro-batches and ``virtual`` stages per rank, checked."""
    build = SCHEDULES.get(name)
    if build is None:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    for what, n in (("pp", pp), ("micro_batches", micro_batches), ("virtual_stages", virtual)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ScheduleError(f"{name}: {what} must be a positive integer, got {n!r}")
    if virtual > 1 and name != "interleaved":
        raise ScheduleError(f"{name}: virtual_stages > 1 needs the interleaved schedule")
    jobs = tuple(tuple(js) for js in build(pp, micro_batches, virtual))
    s = Schedule(name, pp, micro_batches, virtual, jobs)
    s.check()
    return s
