"""Run under ``mpiexec -n 2``: the pipeline runtime over MPI in one launch, what the trainer's MPI
tests (tests/train/test_pipeline_mpi.py: every schedule, pp=2 and pp=2 x dp=2) leave out: static
1f1b stages and a tied-embedding model. Every rank's 20-step losses must equal the single-process
run (computed here by each process) within 1e-5 relative. Prints ``ok <checks>`` on rank 0; a
failure raises and ends the job with status 1."""

from __future__ import annotations

from pipeline_runs import batches, pipelined, single, worst

import llmkit.framework.distributed as dist

if __name__ == "__main__":
    dist.init()
    comm = dist.get_backend()
    assert comm.name == "mpi"
    n, rank = comm.world_size, comm.rank
    data = batches()
    runs = [({}, "1f1b", "static"), ({"tie_word_embeddings": True}, "1f1b", "eager")]
    checks = 0
    reference = {}
    for overrides, name, mode in runs:
        key = tuple(overrides.items())
        want = reference[key] = reference.get(key) or single(data, **overrides)
        got = pipelined(name, 2, n // 2, data=data, rank=rank, mode=mode, **overrides)[rank]
        err = worst(got, want)
        assert err <= 1e-5, f"rank {rank} {name} {mode} {overrides}: relative difference {err:.2e}"
        checks += 1
    comm.barrier()
    if rank == 0:
        print(f"ok {checks}", flush=True)
