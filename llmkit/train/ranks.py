"""The ranks that run one job's loop together, and the collectives of host arrays over them.

``llmkit rlhf`` runs ``parallel.dp`` data-parallel ranks (one process each under mpiexec, or one
thread each on the ``sim`` backend): a step's prompts or pairs are cut into the ranks' contiguous
shares (:meth:`DataParallel.rows`) and its metrics reduced here. ``llmkit train`` agrees over its
processes here (a stop signal, peak memory); its tensors' layout is the plan's (``Parallelized``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import llmkit.framework.distributed as dist

from .config import ConfigError


class DataParallel:
    """This rank's place among ``size`` data-parallel ranks, and the collectives of host arrays
    (metrics, counts) over them; with one rank every collective is the identity."""

    def __init__(self, rank: int = 0, size: int = 1, job: str = "rlhf") -> None:
        self.rank, self.size, self.job = rank, size, job
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
        return dist.get_backend(), f"{self.job} {what} over ranks {list(self.group)}"

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
