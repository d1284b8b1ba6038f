"""Parallel training on the ``sim`` backend (every rank in this process): 20-step losses equal the
single-process run for dp, tp, tp+sp, dp x tp and ZeRO 1-3; a tp=2 checkpoint resumes on dp=2 and on
one process; ZeRO-3 over 4 ranks holds a quarter of the state; sharded checkpoints merge, export and
generate; an incomplete checkpoint is never resumed. The same runs over MPI: test_parallel_mpi.py."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

import llmkit.framework.distributed as dist
from llmkit.cli import main as cli_main
from llmkit.framework.distributed.parallel_plan import ParallelPlan
from llmkit.models.llama import LlamaForCausalLM
from llmkit.train import checkpoint
from llmkit.train.data import BatchSampler
from llmkit.train.metrics import read_metrics
from llmkit.train.trainer import Trainer

from .parallel_runs import STEPS, assert_same_losses, config, losses

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    Trainer(config(out), quiet=True).fit()
    return out


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2") / "run"
    Trainer(config(out, tp=2), quiet=True).fit()
    return out


def evals(run):
    return {r["step"]: r["eval_loss"] for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r}


PLANS = [{"dp": 2}, {"tp": 2, "sp": True}, {"dp": 2, "tp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2},
         {"dp": 2, "zero": 3}]  # fmt: skip
MODES = {"eager": (), "static": ("train.mode=static", "train.compiler=none")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("parallel", PLANS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_losses_equal_the_single_process_run(single, tmp_path, parallel, mode):
    out = tmp_path / "run"
    trainer = Trainer(config(out, *MODES[mode], **parallel), quiet=True)
    trainer.fit()
    if mode == "static":  # one program, traced once and partitioned into one per rank
        assert trainer.static_step.trace_count == 1
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))
    assert_same_losses(evals(out), evals(single), range(10, STEPS + 1, 10))
    last = checkpoint.latest(out)
    plan = ParallelPlan.load(last)
    assert plan == ParallelPlan.make("llama", **parallel)
    ranks = plan.world_size
    assert sorted(p.name for p in (last / "model").glob("rank-*")) == [
        f"rank-{r:05d}.safetensors" for r in range(ranks)
    ]


def test_tp2_losses_and_checkpoint_layout(single, tp2):
    assert_same_losses(losses(tp2), losses(single), range(1, STEPS + 1))
    last = checkpoint.latest(tp2)
    assert {p.name for p in last.iterdir()} == {
        "model", "optimizer", "parallel_plan.json", "trainer_state.json", "COMPLETE",
    }  # fmt: skip
    assert {p.name for p in (last / "optimizer").iterdir()} == {
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    }


@pytest.mark.parametrize("parallel", [{"dp": 2}, {}], ids=["dp2", "one-process"])
def test_a_tp2_checkpoint_resumes_on_another_mesh(single, tp2, tmp_path, parallel):
    out = tmp_path / "run"
    shutil.copytree(tp2, out)
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:08d}")
    trainer = Trainer(config(out, **parallel), resume=True, quiet=True)
    assert trainer.step == 10 and "parallel.tp 2 -> 1" in trainer.resume_changes
    read, total, _ = trainer.load_report
    assert read == total  # dp keeps every weight (and moment) whole on each rank
    trainer.fit()
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))


def test_one_process_checkpoint_resumes_on_tp2_reading_half(single, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(single, out)
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:08d}")
    trainer = Trainer(config(out, tp=2), resume=True, quiet=True)
    read, total, _ = trainer.load_report
    assert 0.5 * total < read < 0.6 * total  # a rank reads its half of the sharded weights (+ norms)
    trainer.fit()
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))


def test_zero3_on_four_ranks_holds_a_quarter_of_the_state(single, tmp_path):
    out = tmp_path / "run"
    Trainer(config(out, "train.steps=2", "lr_schedule.warmup_steps=1", dp=4, zero=3), quiet=True).fit()
    full = read_metrics(single / "metrics.jsonl")[0]["state_bytes_per_rank"]
    quarter = read_metrics(out / "metrics.jsonl")[0]["state_bytes_per_rank"]
    # parameters + gradients + two AdamW moments, float32: the single process holds 4 x 4 bytes each
    model = LlamaForCausalLM.from_pretrained(checkpoint.latest(single) / "model")
    n = sum(int(np.prod(p.shape)) for p in model.parameters())
    assert full == 16 * n
    assert quarter == pytest.approx(full / 4, rel=0.02)


def test_an_incomplete_checkpoint_is_never_resumed(tp2, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(tp2, out)
    ckpts = out / "checkpoints"
    shutil.copytree(
        ckpts / f"step-{STEPS:08d}", ckpts / f".step-{STEPS + 5:08d}.partial"
    )  # a crash while writing
    (ckpts / f"step-{STEPS:08d}" / "COMPLETE").unlink()  # a marker never written
    assert checkpoint.latest(out) == ckpts / "step-00000010"
    (ckpts / "step-00000010" / "COMPLETE").unlink()
    with pytest.raises(checkpoint.ResumeError, match=r"no checkpoint under .*incomplete, no COMPLETE marker"):
        checkpoint.latest(out)


def test_a_sharded_checkpoint_merges_exports_and_generates(tp2, tmp_path, capsys):
    last = checkpoint.latest(tp2)
    assert cli_main(["checkpoint", "merge", str(last), "--out", str(tmp_path / "hf")]) == 0
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    sharded = LlamaForCausalLM.from_pretrained(last / "model")
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    }
    for (name, a), (_, b) in zip(merged.named_parameters(), sharded.named_parameters(), strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
    assert (
        cli_main(["generate", "--model", str(last / "model"), "--prompt", "The", "--max-new-tokens", "4"])
        == 0
    )
    assert cli_main(["export", "--model", str(last / "model"), "--out", str(tmp_path / "m.llmkit")]) == 0
    assert (tmp_path / "m.llmkit").is_dir()


def test_the_static_step_compiled_per_rank(single, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(config(out, "train.mode=static", "train.compiler=cinn", dp=2, tp=2, zero=1), quiet=True)
    trainer.fit()
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))
    runner = trainer.static_step.get_concrete_program(*trainer.draw(0)).executor
    for rank in range(4):  # each rank's partitioned program: collectives, and fused kernels around them
        steps = [s.name for s in runner.executor(rank).steps]
        assert any(n.startswith("dist.") for n in steps) and any(n.startswith("cinn.fusion") for n in steps)


def test_each_dp_rank_reads_its_rows_of_the_same_global_batch(single):
    tokens = np.arange(10_000, dtype=np.uint16)
    sampler = BatchSampler(tokens, batch_size=8, seq_len=5, seed=3)
    x, y = sampler.batch(7)
    for dp in (2, 4):
        rows = [sampler.batch(7, slice(i * 8 // dp, (i + 1) * 8 // dp)) for i in range(dp)]
        np.testing.assert_array_equal(np.concatenate([r[0] for r in rows]), x)
        np.testing.assert_array_equal(np.concatenate([r[1] for r in rows]), y)


def test_nproc_must_match_the_mesh(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text((config(tmp_path / "run", dp=2)).model_dump_json())
    assert cli_main(["train", str(cfg), "--nproc", "3"]) == 2
    assert "parallel.dp (2) x parallel.tp (1) = 2 ranks, but --nproc is 3" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_the_nproc_command_line(tmp_path, monkeypatch):
    from llmkit.train.cli import mpiexec_command

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("llmkit.train.trainer.cpu_count", lambda: 2)
    cfg = config(tmp_path / "run", dp=2, tp=2)
    cmd, env = mpiexec_command(cfg, 4, "hosts", ["c.yaml", "train.steps=3", "--resume"])
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    assert cmd[1:] == ["--oversubscribe", *root, "--hostfile", "hosts", "-n", "4", sys.executable, "-m",
                       "llmkit", "train", "c.yaml", "train.steps=3", "--resume"]  # fmt: skip
    assert env["OMP_NUM_THREADS"] == "1"  # two cores shared by four ranks
    cmd, env = mpiexec_command(config(tmp_path / "run", dp=2), 2, None, ["c.yaml"])
    assert "--oversubscribe" not in cmd and "--hostfile" not in cmd and env["OMP_NUM_THREADS"] == "1"


def test_init_from_a_pretrained_model_places_its_slices(single, tmp_path):
    model = checkpoint.latest(single) / "model"
    plain = Trainer(config(tmp_path / "a", "model.preset=null", f"model.init_from={model}"), quiet=True)
    tp2 = Trainer(config(tmp_path / "b", "model.preset=null", f"model.init_from={model}", tp=2), quiet=True)
    for (name, p), q in zip(plain.model.named_parameters(), tp2.model.parameters(), strict=True):
        np.testing.assert_array_equal(dist.unshard(q).numpy(), p.numpy(), err_msg=name)
