"""Multi-process checks: each launches ``mpiexec --oversubscribe --allow-run-as-root -n N`` on a
script of this directory with a subprocess timeout (a hang is a test failure, not a stuck CI)."""

from __future__ import annotations

import shutil
import time

import pytest
from dist_helpers import run_mpi

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the dist extra's openmpi)"),
]


def _ok(proc, n_checks_at_least: int = 1) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ok ") and int(last.split()[1]) >= n_checks_at_least, proc.stdout


@pytest.mark.parametrize("n,checks", [(2, 36 + 7), (4, 36 + 48 + 2 + 3)])
def test_reshard_transitions_llama_block_and_static_programs_over_mpi(n, checks):
    """mpi_checks.py: every reshard transition (1-D; 2x2 and between meshes on 4), the Llama block
    under dp, tp, sp (2 processes) and dp x tp (4), eager and static, and the TP MLP program."""
    _ok(run_mpi("mpi_checks.py", n, timeout=300), checks)


@pytest.mark.parametrize(
    "mode,flags",
    [
        ("hang", ()),  # rank 1 alive but absent: rank 0 times out
        ("kill", ("--with-ft", "ulfm")),  # rank 1 dead; ULFM reports the failed peer at once
        ("kill", ("--enable-recovery",)),  # rank 1 dead; PRRTE keeps rank 0 running: it times out
    ],
)
def test_a_lost_rank_ends_the_other_with_a_clear_error(mode, flags):
    t0 = time.monotonic()
    proc = run_mpi("mpi_faults.py", 2, mode, timeout=90, flags=flags)
    took = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout
    assert "rank 0 finished" not in proc.stdout
    assert "CollectiveError: all_reduce" in proc.stderr, proc.stderr[-3000:]
    assert "mesh dim 'dp'" in proc.stderr and "on rank 0" in proc.stderr, proc.stderr[-3000:]
    wanted = "a peer process died" if "ulfm" in flags else "timed out after 2s"
    assert wanted in proc.stderr, proc.stderr[-3000:]
    assert took < 60  # the sleeping rank would keep the job alive for 60 s


def test_ranks_that_call_different_collectives_are_told_so():
    """Rank 0 in a barrier, rank 1 in an all-reduce instead: MPI reports only MPI_ERR_IN_STATUS; the
    error names the request's own error (a truncated message) and the likely cause, not a dead peer."""
    proc = run_mpi("mpi_faults.py", 2, "mismatch", timeout=90)
    assert proc.returncode != 0, proc.stdout
    assert "CollectiveError: barrier: failed on rank 0" in proc.stderr, proc.stderr[-3000:]
    assert "MPI_ERR_TRUNCATE" in proc.stderr and "called different collectives" in proc.stderr, proc.stderr[
        -3000:
    ]
    assert "a peer process died" not in proc.stderr, proc.stderr[-3000:]
