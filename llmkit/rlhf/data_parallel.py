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

from collections.abc import Callable
from typing import TypeVar

import llmkit.framework.distributed as dist
from llmkit.train.loop import StopSignals
from llmkit.train.ranks import DataParallel

__all__ = ["DataParallel", "run_on_ranks"]  # DataParallel lives with the loop it serves

T = TypeVar("T")


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
