"""Parallel training over MPI: ``llmkit train --nproc N`` and plain ``mpiexec -n N llmkit train``
give the single-process losses; a tp=2 checkpoint resumes on dp=2 with ZeRO 3; kill -9 of a rank
ends the job with an error naming it (no hang), and --resume continues exactly. Every launch has a
subprocess timeout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmkit.train import checkpoint
from llmkit.train.trainer import Trainer

from .parallel_runs import ROOT, STEPS, TINY, assert_same_losses, config, losses, overrides

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the dist extra's openmpi)"),
]
LAUNCH = ["--oversubscribe", "--allow-run-as-root"]


def env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMPI_MCA_rmaps_base_oversubscribe="1", **extra)


def llmkit(*args: str, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llmkit", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(**extra), cwd=ROOT)


def mpiexec(n: int, *args: str, flags: tuple = (), timeout: float = 300, **extra: str):
    cmd = ["mpiexec", *LAUNCH, *flags, "-n", str(n), sys.executable, "-m", "llmkit", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(**extra), cwd=ROOT)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    Trainer(config(out), quiet=True).fit()
    return out


def test_nproc_runs_mpiexec_and_rank0_alone_logs(single, tmp_path):
    out = tmp_path / "run"
    stdout = ok(llmkit("train", str(TINY), *overrides(out, dp=2), "--nproc", "2", "--quiet"))
    assert "parallel: dp=2 x tp=1, plan llama on mpi (2 ranks)" in stdout
    assert stdout.count("done: step 20") == 1  # rank 0 alone prints, logs and writes the metrics
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))
    assert (out / "sample.txt").read_text().startswith("The")


def test_plain_mpiexec_with_four_ranks_static(single, tmp_path):
    out = tmp_path / "run"
    args = overrides(out, dp=2, tp=2, sp=True, zero=1)
    ok(mpiexec(4, "train", str(TINY), *args, "train.mode=static", "train.compiler=none", "--quiet"))
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))


def test_a_tp2_checkpoint_resumes_on_dp2_with_zero3(single, tmp_path):
    out = tmp_path / "run"
    ok(llmkit("train", str(TINY), *overrides(out, tp=2), "--nproc", "2", "--quiet"))
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:08d}")
    stdout = ok(
        llmkit("train", str(TINY), *overrides(out, dp=2, zero=3), "--resume", "--nproc", "2", "--quiet")
    )
    assert "resume: step 10 from" in stdout and "MB per rank; peak host memory" in stdout
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))


def test_the_world_must_match_the_mesh(tmp_path):
    proc = mpiexec(2, "train", str(TINY), *overrides(tmp_path / "run", dp=1), "--quiet", timeout=120)
    assert proc.returncode != 0
    assert "parallel.dp (1) x parallel.tp (1) = 1 ranks, but this run has 2 processes" in proc.stderr


def rank_pid(out: Path, rank: int) -> int | None:
    """The pid of the training process of ``rank`` writing to ``out`` (from /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(out).encode() in cmd and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(pid)
    return None


def kill_rank_after_a_checkpoint(proc: subprocess.Popen, out: Path) -> float:
    """Wait for the step-5 checkpoint, kill -9 rank 1; return when it was killed."""
    deadline = time.monotonic() + 240
    while not (out / "checkpoints" / "step-00000005" / "COMPLETE").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (
            "the run ended before its first checkpoint"
        )
        time.sleep(0.2)
    pid = rank_pid(out, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds rank 1 through /proc")
@pytest.mark.parametrize("recovery", [False, True], ids=["mpiexec-ends-the-job", "survivor-times-out"])
def test_kill_9_of_a_rank_is_a_clear_error_and_resume_is_exact(single, tmp_path, recovery):
    out = tmp_path / "run"
    args = ["train", str(TINY), *overrides(out, dp=2), "train.save_every=5", "--quiet"]
    if recovery:  # PRRTE keeps the survivor running: it meets the dead rank in a collective
        cmd = ["mpiexec", *LAUNCH, "--enable-recovery", "-n", "2", sys.executable, "-m", "llmkit", *args]
    else:
        cmd = [sys.executable, "-m", "llmkit", *args, "--nproc", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(LLMKIT_DIST_TIMEOUT="5"), cwd=ROOT)  # fmt: skip
    try:
        killed = kill_rank_after_a_checkpoint(proc, out)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0 and time.monotonic() - killed < 60, stderr[-3000:]
    if recovery:
        assert "timed out after 5s on rank 0 waiting for ranks [1]" in stderr, stderr[-3000:]
        assert checkpoint.latest(out).name >= "step-00000005"  # the last complete one stays
        return
    assert "rank 1" in stderr and "signal 9" in stderr, stderr[-3000:]
    ok(llmkit("train", str(TINY), *overrides(out, dp=2), "--resume", "--nproc", "2", "--quiet"))
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))
