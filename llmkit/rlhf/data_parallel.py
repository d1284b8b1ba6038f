"""Data-parallel RLHF: ``parallel.dp`` ranks, each with its own policy, engine and compiled step.

    llmkit rlhf cfg.yaml parallel.dp=2 --nproc 2     # one process per rank (mpiexec)
    llmkit rlhf cfg.yaml parallel.dp=2               # one process, one thread per rank (sim)

A step's prompts (DPO's and the reward model's pairs) are cut into ``dp`` contiguous shares
(:meth:`DataParallel.rows`): rank r rolls out its prompts, each sampled ``n`` times, on its own
engine over its own live weights, so a prompt's group of samples never leaves its rank (GRPO's and
RLOO's advantages are the group's). A rank's loss is its rows' share of the whole batch's (its sums
divided by the whole batch's counts) and its compiled step all-reduces the gradients
(``all_reduce_grads``) before clipping and the optimizer: every rank applies the same update, so
the ranks' weights stay equal, and equal to the one-process run's up to the order of float sums.
Metrics are reduced here (``gather``, ``sum``, ``max``); rank 0 alone logs and writes checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

import llmkit.framework.distributed as dist
from llmkit.train.config import ConfigError
from llmkit.train.trainer import StopSignals

T = TypeVar("T")


class DataParallel:
    """This rank's place among ``size`` data-parallel ranks, and the collectives of host arrays
    (metrics, counts) over them; with one rank every collective is the identity."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank, self.size = rank, size
        self.group = tuple(range(size))

    @classmethod
    def join(cls, dp: int) -> DataParallel:
        """This process's (under ``sim``: this thread's) rank of a ``dp``-rank run."""
        if dp == 1 and not dist.comm.launched_by_mpi():
            return cls()
        b = dist.get_backend()
        if b.name == "sim":
            rank = b.thread_rank
            if rank is None or rank >= dp:
                raise RuntimeError(
                    f"parallel.dp={dp} in one process runs each rank on a thread: build the job inside "
                    "llmkit.rlhf.data_parallel.run_on_ranks (as llmkit rlhf does), or launch with --nproc"
                )
            return cls(rank, dp)
        if b.world_size != dp:
            raise ConfigError(
                f"parallel.dp ({dp}) = {dp} ranks, but this run has {b.world_size} processes "
                "(mpiexec -n / --nproc); make them equal"
            )
        return cls(b.rank, dp)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def sizes(self, n: int) -> list[int]:
        """The ranks' shares of ``n`` rows (as ``np.array_split`` cuts them: even when ``size``
        divides ``n``, which the configs require of a step's prompts and pairs)."""
        return [len(part) for part in np.array_split(np.arange(n), self.size)]

    def rows(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` rows."""
        sizes = self.sizes(n)
        start = sum(sizes[: self.rank])
        return slice(start, start + sizes[self.rank])

    # ---- collectives (every rank calls them, in the same order) ---------------------------------
    def _comm(self, what: str) -> tuple[dist.comm.Backend, str]:
        return dist.get_backend(), f"rlhf {what} over data-parallel ranks {list(self.group)}"

    def sum(self, a: np.ndarray | Sequence[float], what: str = "sum") -> np.ndarray:
        return self._reduce(a, "sum", what)

    def max(self, a: np.ndarray | Sequence[float], what: str = "max") -> np.ndarray:
        return self._reduce(a, "max", what)

    def _reduce(self, a: np.ndarray | Sequence[float], op: str, what: str) -> np.ndarray:
        a = np.asarray(a, dtype=np.float64)
        if self.size == 1:
            return a
        comm, where = self._comm(what)
        return comm.all_reduce(self.group, {self.rank: a}, op, where)[self.rank]

    def gather(self, a: np.ndarray, sizes: Sequence[int] | None = None, what: str = "gather") -> np.ndarray:
        """The ranks' arrays concatenated along axis 0 in rank order (rank i gives ``sizes[i]``
        rows; default: every rank as many as this one)."""
        a = np.ascontiguousarray(a)
        if self.size == 1:
            return a
        comm, where = self._comm(what)
        sizes = list(sizes) if sizes is not None else [len(a)] * self.size
        return comm.all_gather(self.group, {self.rank: a}, 0, sizes, where)[self.rank]


def run_on_ranks(job: Callable[[StopSignals | None], T], dp: int) -> T:
    """``job(stop)`` on this process's data-parallel ranks; returns rank 0's result (under mpiexec:
    this process's). One rank, or one process per rank (mpiexec): ``job(None)`` here, its run
    handles signals itself. Several ranks in one process: one thread per rank on the ``sim``
    backend, sharing the main thread's ``StopSignals`` (a signal stops every rank after its step)."""
    if dp == 1 or dist.comm.launched_by_mpi():
        return job(None)
    b = dist.init("sim")
    if b.world_size < dp:
        dist.init("sim", world_size=dp)
    with StopSignals() as stop:
        return dist.run_ranks(range(dp), lambda rank: job(stop))[0]
