"""Run under ``mpiexec -n 2|4``: every MPI check in one launch (starting processes costs more than
the checks): the reshard transitions (mpi_reshard.py), then the Llama block and the static programs
(mpi_models.py). Prints ``ok <checks>`` on rank 0; a failure raises, and the mpi backend ends the job
with status 1."""

from __future__ import annotations

import mpi_models
import mpi_reshard

import llmkit.framework.distributed as dist

if __name__ == "__main__":
    dist.init()
    assert dist.get_backend().name == "mpi"
    n = mpi_reshard.run() + mpi_models.run()
    if dist.get_rank() == 0:
        print(f"ok {n}", flush=True)
