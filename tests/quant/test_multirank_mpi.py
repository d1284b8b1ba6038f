"""Quantization over MPI: a checkpoint of ``llmkit train ... parallel.tp=2`` quantized by ``llmkit
quantize --nproc 2`` and by ``mpiexec -n 4 ... quantize`` gives the one-process checkpoint, bit for
bit (codes, scales, zeros, every float tensor), hence its perplexity; the quantized directory keeps
the plan with the scales' placements and loads. Every launch has a subprocess timeout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from framework.distributed.dist_helpers import ROOT, run_mpi

from llmkit.framework.distributed.parallel_plan import PLAN_FILE, ParallelPlan
from llmkit.framework.placement import Shard
from llmkit.models.llama import LlamaForCausalLM
from llmkit.quant.cli import eval_main, quantize_main
from llmkit.train.trainer import Trainer

pytestmark = pytest.mark.slow
sys.path.insert(0, str(ROOT / "tests" / "train"))
from parallel_runs import config  # noqa: E402  (the tiny parallel-training runs)

# Wider than parallel_runs' model, so every weight has several row blocks (gptq.ROWS = 64) and each
# of 4 ranks quantizes rows of the MLP: q/k/v/o [128, 128], gate/up [384, 128], down [128, 384].
WIDE = ["model.hidden_size=128", "model.intermediate_size=384", "train.steps=6", "train.save_every=6"]
ARGS = ["--bits", "4", "--group", "32", "--asym", "--calib-samples", "20", "--seq-len", "16"]
ARGS += ["--eval-tokens", "512", "--quiet"]


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp2") / "run"
    Trainer(config(out, *WIDE, tp=2), quiet=True).fit()
    return out


@pytest.fixture(scope="module")
def one(tp2_run, tmp_path_factory) -> Path:
    """The checkpoint quantized by one process (one rank, sim)."""
    out = tmp_path_factory.mktemp("one") / "q"
    assert quantize_main(["--model", str(tp2_run), *ARGS, "--out", str(out)]) == 0
    return out


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the dist extra's openmpi)")
def test_nproc_2_and_mpiexec_4_give_the_one_process_bits(tp2_run, one, tmp_path, capsys):
    two, four = tmp_path / "two", tmp_path / "four"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = [sys.executable, "-m", "llmkit", "quantize", "--model", str(tp2_run), *ARGS, "--out", str(two)]
    proc = subprocess.run([*cmd, "--nproc", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s) on mpi" in proc.stdout
    script = ROOT / "tests" / "quant" / "mpi_quantize.py"
    proc = run_mpi(str(script), 4, "--model", str(tp2_run), *ARGS, "--out", str(four), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 rank(s) on mpi" in proc.stdout
    want = (one / "model.safetensors").read_bytes()
    for d in (two, four):
        assert (d / "model.safetensors").read_bytes() == want, d
        assert (d / PLAN_FILE).read_bytes() == (one / PLAN_FILE).read_bytes()
        reports = [json.loads((x / "quant_report.json").read_text()) for x in (one, d)]
        assert reports[0]["perplexity"] == reports[1]["perplexity"]  # equal floats: the same bits ran
    capsys.readouterr()
    for d in (one, two):
        assert eval_main(["--model", str(d), "--max-tokens", "512", "--seq-len", "16"]) == 0
    a, b = capsys.readouterr().out.splitlines()
    assert a.split()[:2] == b.split()[:2] and a.startswith("perplexity"), (a, b)


def test_the_quantized_directory_keeps_the_plan_and_loads(tp2_run, one):
    report = json.loads((one / "quant_report.json").read_text())
    assert (
        report["parallel"]["plan"].endswith(f"step-00000006/{PLAN_FILE}") and report["parallel"]["ranks"] == 1
    )
    plan = ParallelPlan.load(one)
    src = ParallelPlan.load(next((tp2_run / "checkpoints").glob("step-*")))
    assert plan.mesh == src.mesh and plan.params[-len(src.params) :] == src.params
    assert plan.tp_placement("model.layers.0.mlp.down_proj.scales") == Shard(1)
    assert plan.tp_placement("model.layers.0.mlp.up_proj.zeros") == Shard(0)
    model = LlamaForCausalLM.from_pretrained(str(one))
    assert model.config.extra["quantization_config"]["group_size"] == 32


def test_a_straddling_group_is_one_line_before_any_work(tp2_run, tmp_path, capsys):
    from llmkit.cli import main

    argv = ["quantize", "--model", str(tp2_run), "--bits", "4", "--out", str(tmp_path / "q"), "--quiet"]
    assert main(argv) == 2  # the default group of 128 over o_proj's shards of 64 columns
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not (tmp_path / "q").exists()
    assert "o_proj.weight [128, 128] is row parallel (S(1)) over tp=2: shards of 64 input columns" in err
    assert "groups of 128 input columns" in err
