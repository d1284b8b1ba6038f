"""Run under ``mpiexec -n 2``: one rank fails, the other must end with a clear error, never hang.

``hang``: rank 1 skips an all-reduce (it sleeps); ``kill``: rank 1 kills itself with SIGKILL.
Rank 0's all-reduce then fails with a CollectiveError (a timeout, or the failed peer under
``--with-ft ulfm``) and the process exits with status 1. ``mismatch``: rank 1 skips the barrier
rank 0 waits in and calls an all-reduce, which rank 0's barrier meets (a message it cannot take).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import llmkit.framework.distributed as dist


def main(mode: str) -> None:
    dist.init("mpi", timeout=2)
    mesh = dist.ProcessMesh((2,), ["dp"])
    x = dist.from_local(np.ones(4), mesh, [dist.Partial()], (4,))
    dist.reshard(x, mesh, [dist.Replicate()])  # everyone is alive here
    print(f"rank {dist.get_rank()} ready", flush=True)
    if mode == "mismatch" and dist.get_rank() == 0:
        dist.get_backend().barrier()
    if dist.get_rank() == 1:
        if mode == "mismatch":
            dist.reshard(x, mesh, [dist.Replicate()])
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        sys.exit(0)
    dist.reshard(x, mesh, [dist.Replicate()])
    print("rank 0 finished (unexpected)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
