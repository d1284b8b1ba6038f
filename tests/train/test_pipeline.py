"""Pipeline-parallel training through the trainer on ``sim`` (each rank on its own thread): every
schedule's 20-step losses (and evaluations) equal the single-process run with pp=2 and pp=2 x dp=2;
with tp, ZeRO 1 and 3, static mode and a tied embedding too; the plan records the pipeline; a pp=2
checkpoint resumes on one process and a one-process checkpoint on pp=2 x dp=2, with the weights
equal; bad pipeline settings are one clear error each. The same runs over MPI:
test_pipeline_mpi.py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from llmkit.cli import main as cli_main
from llmkit.framework.distributed.parallel_plan import ParallelPlan, PipelinePlan
from llmkit.models.llama import LlamaForCausalLM
from llmkit.train import checkpoint
from llmkit.train.config import ConfigError
from llmkit.train.trainer import Trainer

from .parallel_runs import PP_LAYERS as LAYERS
from .parallel_runs import PP_SCHEDULES as SCHEDULES
from .parallel_runs import STATIC, STEPS, assert_same_losses, config, losses, pp
from .test_parallel import evals

pytestmark = pytest.mark.slow

WARMUP = "train.steps=5"  # the warmup's steps: their learning rates do not depend on the run's length


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    Trainer(config(out, LAYERS), quiet=True).fit()
    return out


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_schedule_trains_as_one_process(single, tmp_path, schedule, dp):
    out = tmp_path / "run"
    parallel = pp(schedule, dp=dp)
    Trainer(config(out, LAYERS, **parallel), quiet=True).fit()
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))
    assert_same_losses(evals(out), evals(single), range(10, STEPS + 1, 10))
    last = checkpoint.latest(out)
    plan = ParallelPlan.load(last)
    assert plan.pipeline == PipelinePlan(2, schedule, 2, parallel.get("virtual_stages", 1))
    assert plan.world_size == 2 * dp
    # one file per rank; the weights are the whole model's, each written once
    assert len(list((last / "model").glob("rank-*"))) == 2 * dp
    merged = LlamaForCausalLM.from_pretrained(last / "model")
    want = LlamaForCausalLM.from_pretrained(checkpoint.latest(single) / "model")
    for (name, a), (_, b) in zip(merged.named_parameters(), want.named_parameters(), strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-3, atol=2e-5, err_msg=name)


@pytest.mark.parametrize(
    "parallel,extra",
    [
        ({"tp": 2}, ()),
        ({"tp": 2, "sp": True}, STATIC),
        ({"dp": 2, "zero": 1}, ()),
        ({"dp": 2, "zero": 1}, STATIC),
        ({"dp": 2, "zero": 3}, ()),
        ({"dp": 2}, STATIC),
    ],
    ids=["tp2", "tp2-sp-static", "dp2-zero1", "dp2-zero1-static", "dp2-zero3", "dp2-static"],
)
def test_with_tp_zero_and_static_stages(single, tmp_path, parallel, extra):
    out = tmp_path / "run"
    Trainer(config(out, LAYERS, *extra, WARMUP, **pp("1f1b", **parallel)), quiet=True).fit()
    assert_same_losses(losses(out), losses(single), range(1, 6))


def test_a_tied_embedding_on_the_first_and_last_stage(tmp_path):
    tied = ("model.tie_word_embeddings=true", "train.steps=6", "train.save_every=3")
    Trainer(config(tmp_path / "one", LAYERS, *tied), quiet=True).fit()
    Trainer(config(tmp_path / "pp", LAYERS, *tied, **pp("zero_bubble")), quiet=True).fit()
    assert_same_losses(losses(tmp_path / "pp"), losses(tmp_path / "one"), range(1, 7))
    resumed = tmp_path / "resumed"  # the embedding's one copy on disk feeds both stages' copies
    shutil.copytree(tmp_path / "pp", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000006")
    Trainer(config(resumed, LAYERS, *tied, **pp("1f1b")), resume=True, quiet=True).fit()
    assert_same_losses(losses(resumed), losses(tmp_path / "one"), range(1, 7))


@pytest.mark.parametrize(
    "before,after",
    [(pp("1f1b"), {}), ({}, pp("interleaved", dp=2))],
    ids=["pp2-to-one-process", "one-process-to-pp2xdp2"],
)
def test_a_checkpoint_resumes_across_pipeline_sizes(single, tmp_path, before, after):
    out = tmp_path / "run"
    if before:
        Trainer(config(out, LAYERS, **before), quiet=True).fit()
    else:
        shutil.copytree(single, out)
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:08d}")
    trainer = Trainer(config(out, LAYERS, **after), resume=True, quiet=True)
    assert trainer.step == 10
    trainer.fit()
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))
    got = LlamaForCausalLM.from_pretrained(checkpoint.latest(out) / "model")
    want = LlamaForCausalLM.from_pretrained(checkpoint.latest(single) / "model")
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-3, atol=2e-5, err_msg=name)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["parallel.micro_batches=2"], "parallel.micro_batches applies to pipelines: set parallel.pp > 1"),
        (["parallel.pp=2", "parallel.virtual_stages=2"], r"parallel.virtual_stages \(2\) needs "
         "parallel.schedule=interleaved"),
        (["parallel.pp=2", "parallel.schedule=interleaved"], "parallel.virtual_stages: the interleaved"),
        (["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
          "parallel.micro_batches=1"], r"parallel.micro_batches \(1\) must be a multiple of "
         r"parallel.pp \(2\)"),
        (["parallel.pp=2", "parallel.schedule=gpipe"], "parallel.schedule: expected 'fthenb', '1f1b'"),
        (["parallel.pp=2", "parallel.pp_stages=[0-3]"], r"parallel.pp_stages: 1 layer ranges for 2 stages"),
        (["parallel.pp=2", "parallel.micro_batches=3"], r"train.batch_size \(4\) must be a multiple of "
         r"parallel.micro_batches \(3\)"),
        (["parallel.pp=2", "parallel.dp=4", "parallel.micro_batches=2"], r"a micro-batch's 2 rows must be a "
         r"multiple of parallel.dp \(4\)"),
        (["parallel.pp=2", "train.grad_accum=2"], "train.grad_accum > 1 with a pipeline"),
    ],
)  # fmt: skip
def test_bad_pipeline_settings(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, LAYERS, *overrides)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["parallel.pp_stages=[0-1, 3-3]"], r"parallel.pp_stages\[1\]: '3-3' should start at layer 2"),
        (["parallel.pp_stages=[0-1, 2-2]"], "parallel.pp_stages: the ranges cover layers 0-2; the "
         "model has 4"),
        (["model.num_hidden_layers=1"], r"parallel.pp: 2 pipeline stages need at least as many layers; the "
         r"model has 1"),
    ],
)  # fmt: skip
def test_stages_that_do_not_cover_the_layers(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(config(tmp_path / "run", LAYERS, "parallel.pp=2", *overrides), quiet=True)


def test_pp_must_divide_the_ranks(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(config(tmp_path / "run", LAYERS, pp=2).model_dump_json())
    assert cli_main(["train", str(cfg), "--nproc", "3"]) == 2
    assert "parallel.pp (2) does not divide the ranks (--nproc is 3)" in capsys.readouterr().err
    assert cli_main(["train", str(cfg), "--nproc", "4"]) == 2
    assert "parallel.pp (2) x parallel.dp (1) x parallel.tp (1) = 2 ranks, but --nproc is 4" in (
        capsys.readouterr().err
    )


def test_stages_from_layer_ranges(single, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(config(out, LAYERS, WARMUP, "parallel.pp_stages=[0-2, 3-3]", **pp("1f1b")), quiet=True)
    assert trainer.pipe.pipe.stages == (range(0, 3), range(3, 4))
    assert "stage 1 (pp 1): layers 3-3 + last" in trainer.pipe.describe()
    trainer.fit()
    assert_same_losses(losses(out), losses(single), range(1, 6))
