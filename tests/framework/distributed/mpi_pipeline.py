"""Run under ``mpiexec -n 2|4``: pipeline training over MPI in one launch. With 2 processes, pp=2
with each schedule and a tied-embedding model; with 4, pp=2 x dp=2 with each schedule. Every
rank's 20-step losses must equal the single-process run (computed here by each process) within
1e-5 relative. Prints ``ok <checks>`` on rank 0; a failure raises and ends the job with status 1."""

from __future__ import annotations

from pipeline_runs import SCHEDULES, batches, pipelined, single, worst

import llmkit.framework.distributed as dist

if __name__ == "__main__":
    dist.init()
    comm = dist.get_backend()
    assert comm.name == "mpi"
    n, rank = comm.world_size, comm.rank
    data = batches()
    runs = [({}, name) for name in SCHEDULES]
    if n == 2:
        runs.append(({"tie_word_embeddings": True}, "1f1b"))
    checks = 0
    reference = {}
    for overrides, name in runs:
        key = tuple(overrides.items())
        want = reference[key] = reference.get(key) or single(data, **overrides)
        got = pipelined(name, 2, n // 2, data=data, rank=rank, **overrides)[rank]
        err = worst(got, want)
        assert err <= 1e-5, f"rank {rank} {name} {overrides}: relative difference {err:.2e}"
        checks += 1
    comm.barrier()
    if rank == 0:
        print(f"ok {checks}", flush=True)
