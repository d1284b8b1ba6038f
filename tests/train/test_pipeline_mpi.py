"""Pipeline training over MPI, through the trainer: ``llmkit train --nproc 2`` with pp=2 gives the
single-process losses, rank 0 alone logging them, and its checkpoint resumes on one process; one
launch of 2 processes trains with every other schedule (and static stages), one of 4 with every
schedule at pp=2 x dp=2, each run's 20 losses equal to one process's. Every launch has a timeout."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from llmkit.train.trainer import Trainer

from .parallel_runs import (
    PP_LAYERS,
    PP_SCHEDULES,
    ROOT,
    STEPS,
    TINY,
    assert_same_losses,
    config,
    losses,
    overrides,
    pp,
)
from .test_parallel_mpi import LAUNCH, env, llmkit, ok

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the dist extra's openmpi)"),
]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    Trainer(config(out, PP_LAYERS), quiet=True).fit()
    return out


def test_nproc_2_with_pp_2_and_resume_on_one_process(single, tmp_path):
    out = tmp_path / "run"
    parallel = [f"parallel.{k}={v}" for k, v in pp("1f1b").items()]
    stdout = ok(llmkit("train", str(TINY), *overrides(out), PP_LAYERS, *parallel, "--nproc", "2"))
    assert "parallel: pp=2 x dp=1 x tp=1, 1f1b x 2 micro-batches, plan llama on mpi (2 ranks)" in stdout
    assert "stage 1 (pp 1): layers 3-3 + last" in stdout  # balanced: the head costs about a layer
    assert "rank 0: F0 F1 B0 B1" in stdout and "rank 1: F0 B0 F1 B1" in stdout  # the job lists
    assert stdout.count("done: step 20") == 1  # rank 0 alone prints and logs
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:08d}")
    trainer = Trainer(config(out, PP_LAYERS), resume=True, quiet=True)  # saved at pp=2, resumed at pp=1
    assert trainer.step == 10 and "parallel.pp 2 -> 1" in trainer.resume_changes
    trainer.fit()
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))


@pytest.mark.parametrize(
    "n,specs",
    [(2, ["fthenb", "interleaved", "zero_bubble", "zero_bubble:static"]), (4, list(PP_SCHEDULES))],
    ids=["pp2", "pp2xdp2"],
)
def test_every_schedule_in_one_launch(single, tmp_path, n, specs):
    script = "tests/train/mpi_pipeline_train.py"
    cmd = ["mpiexec", *LAUNCH, "-n", str(n), sys.executable, script, str(tmp_path), *specs]
    ok(subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=ROOT))
    for spec in specs:
        assert_same_losses(losses(tmp_path / spec), losses(single), range(1, STEPS + 1))
