"""LoRA with the parallel plans: each adapter's A/B laid out from its base weight's placement (the
plan's rule, against Megatron's layout written out here), and dp, ZeRO and tp LoRA runs on the
``sim`` backend equal to the one-process run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework.distributed.parallel_plan import ParallelPlan
from llmkit.framework.placement import Replicate, Shard
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.lora import LoraConfig, apply_lora
from llmkit.models.llama.sharding import check_plan
from llmkit.train.trainer import Trainer

from .parallel_runs import ROOT, STEPS, TINY, assert_same_losses, config, losses, overrides

R = Replicate()

# y = W x + B (A x), W [out, in], A [r, in], B [out, r]. Column-parallel W (outputs split, S(0)):
# each rank computes its outputs' slice of the update, so B is split on out with W and A is whole.
# Row-parallel W (inputs split, S(1)): each rank's A x is a partial sum over its inputs, reduced
# with W x's, so A is split on in with W and B is whole.
ADAPTERS = {
    "q_proj": (R, Shard(0)),  # (A, B)
    "k_proj": (R, Shard(0)),
    "v_proj": (R, Shard(0)),
    "gate_proj": (R, Shard(0)),
    "up_proj": (R, Shard(0)),
    "o_proj": (Shard(1), R),
    "down_proj": (Shard(1), R),
}


@pytest.fixture(scope="module")
def model():
    m = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=512, num_hidden_layers=2))
    apply_lora(m, LoraConfig(r=4, targets=("all-linear",)), seed=0)
    return m


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_adapter_placements_follow_their_base_weight(model, zero):
    plan = ParallelPlan.make("llama", dp=2, tp=2, zero=zero)
    check_plan(plan, model)
    seen = 0
    for name, p in model.named_parameters():
        layer, _, factor = name.rpartition(".")
        if factor not in ("lora_A", "lora_B"):
            continue
        want = ADAPTERS[layer.rpartition(".")[2]][factor == "lora_B"]
        got = plan.param_placements(name, p.shape)
        assert got[1] == want, name
        # ZeRO 3 shards a factor over dp on a dim tp leaves whole (the rank r of B when tp splits out)
        dp_dim = 1 if want == Shard(0) else 0
        assert got[0] == (Shard(dp_dim) if zero >= 3 else R), name
        assert plan.state_placements(name, p.shape)[0] == (Shard(dp_dim) if zero >= 1 else R), name
        seen += 1
    assert seen == 2 * 7 * 2  # A and B of 7 projections in 2 layers


def test_a_user_plan_needs_no_rule_for_the_adapters():
    """The adapters follow whatever the plan gives their base weight (here: q column, o row, the rest
    replicated by the default rule), with no glob of their own."""
    plan = ParallelPlan.make(
        {"params": {"*.q_proj.weight": "S(0)", "*.o_proj.weight": "S(1)", "*": "R"}}, tp=2
    )
    at = lambda n: plan.tp_placement(f"model.layers.0.self_attn.{n}")
    assert (at("q_proj.lora_A"), at("q_proj.lora_B")) == (R, Shard(0))
    assert (at("o_proj.lora_A"), at("o_proj.lora_B")) == (Shard(1), R)
    assert (at("v_proj.lora_A"), at("v_proj.lora_B")) == (R, R)


# ---- runs on the sim backend ------------------------------------------------------------------------
LORA = ("lora.r=4", "lora.alpha=8", "lora.targets=all-linear", "optim.lr=1e-2")
PLANS = [{"dp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 3}, {"tp": 2}, {"dp": 2, "tp": 2, "zero": 2}]
STATIC = ("train.mode=static", "train.compiler=none")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    Trainer(config(out, *LORA), quiet=True).fit()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("parallel", PLANS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_lora_losses_equal_the_single_process_run(single, tmp_path, parallel, mode):
    """The adapters data parallel (their gradients summed over dp), ZeRO-sharded (their optimizer
    state, gradients, themselves) and tensor parallel (A/B laid out from the base): the same losses
    as one process, to float32 rounding; the checkpoint is the one-process run's adapter."""
    out = tmp_path / "run"
    trainer = Trainer(config(out, *LORA, *(STATIC if mode == "static" else ()), **parallel), quiet=True)
    params = dict(trainer.model.named_parameters())
    trained = [n for n, p in params.items() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    for name in trained:  # laid out as the plan says (the rule tested above)
        assert tuple(params[name]._data.placements) == trainer.plan.param_placements(name, params[name].shape)
    trainer.fit()
    want = losses(single)
    assert len(set(want.values())) > 1  # the adapters train
    assert_same_losses(losses(out), want, range(1, STEPS + 1))
    last = f"checkpoints/step-{STEPS:08d}/adapter/adapter_model.safetensors"
    got, want = lf.load(out / last), lf.load(single / last)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=1e-4, atol=1e-6, err_msg=k)


RESUMES = [({"tp": 2}, {}), ({"dp": 2, "zero": 3}, {"tp": 2}), ({}, {"dp": 2, "zero": 1})]


@pytest.mark.slow
@pytest.mark.parametrize("first,then", RESUMES, ids=["tp2-to-one", "zero3-to-tp2", "one-to-zero1"])
def test_a_lora_checkpoint_resumes_on_any_layout(single, tmp_path, first, then):
    """Half a run on one layout, the rest resumed on another: the adapters (whole, in PEFT's files)
    and their optimizer state (pieces) are laid out as the new plan says; the losses are the
    one-process run's."""
    out = tmp_path / "run"
    Trainer(config(out, *LORA, **first), quiet=True).fit()
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:08d}")  # resume from the middle one
    resumed = Trainer(config(out, *LORA, **then), resume=True, quiet=True)
    assert resumed.step == STEPS // 2
    resumed.fit()
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the dist extra's openmpi)")
def test_lora_over_mpi_is_the_one_process_run(single, tmp_path):
    """Two processes (dp=2 x tp=2 needs four; tp=2 keeps the launch small): rank 0 writes the
    preset's random base once, every rank hashes it, the adapters are gathered into PEFT's files;
    resumed from the middle checkpoint the run still gives the one-process losses."""
    out = tmp_path / "run"
    args = ["train", str(TINY), *overrides(out, tp=2), *LORA, "--nproc", "2", "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMPI_MCA_rmaps_base_oversubscribe="1")
    run = lambda *more: subprocess.run(
        [sys.executable, "-m", "llmkit", *args, *more], capture_output=True, text=True, timeout=300, env=env
    )
    proc = run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:08d}")
    proc = run("--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resume: step {STEPS // 2} from" in proc.stdout
    assert_same_losses(losses(out), losses(single), range(1, STEPS + 1))
    assert (out / "checkpoints" / f"step-{STEPS:08d}" / "adapter" / "adapter_config.json").is_file()
