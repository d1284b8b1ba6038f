"""The planner: its memory model against ZeRO's published figures and against the activations the
autograd tape really keeps, its choice (never a plan its own model says does not fit; the plain
plan for one rank; a clear error naming the smallest memory needed), the pipeline's in-flight
micro-batches, and ``llmkit plan`` / ``parallel: auto``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llmkit.framework as lf
from llmkit.framework.autograd import saved_bytes
from llmkit.framework.distributed import plan_search
from llmkit.framework.distributed.parallel_plan import ParallelPlan, PlanError
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.sharding import apply_recompute, llama_cost

FAST = plan_search.Link(1e-6, 1e-10)
MACHINE = plan_search.Machine("test", 1e12, 1e11, FAST, plan_search.Link(1e-5, 1e-9), node=8)


def toy(params: float = 1e6, layers: int = 4, act: float = 100.0) -> plan_search.ModelCost:
    return plan_search.ModelCost(
        name="toy",
        layers=layers,
        hidden=64,
        layer_params=int(params),
        edge_params=(int(params), int(params)),
        layer_flops=2 * params,
        edge_flops=(0.0, 2 * params),
        layer_act={"none": (act, 3 * act), "attention": (act, act), "full": (act / 4, 0.0)},
        edge_act=((act / 4, 0.0), (act / 4, act)),
        recompute_flops={"none": 0.0, "attention": params / 2, "full": 2 * params},
        seq_len=128,
        heads=8,
    )


@pytest.mark.parametrize(
    ("zero", "published_gb"),  # ZeRO (Rajbhandari et al. 2020), figure 1: Psi = 7.5B, Nd = 64, K = 12
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_state_memory_is_zeros_published_figure(zero, published_gb):
    psi = 7.5e9
    cost = dataclasses.replace(
        toy(),
        layers=1,
        layer_params=int(psi),
        edge_params=(0, 0),
        layer_act=dict.fromkeys(plan_search.RECOMPUTE, (0.0, 0.0)),
    )
    cost = dataclasses.replace(cost, edge_act=((0.0, 0.0), (0.0, 0.0)))
    c = plan_search.estimate(
        cost,
        MACHINE,
        64,
        dp=64,
        tp=1,
        pp=1,
        zero=zero,
        recompute="none",
        micro_batches=1,
        precision=plan_search.MIXED,
    )
    assert c.memory / 1e9 == pytest.approx(published_gb, abs=0.05)


@pytest.mark.parametrize("policy", ["none", "attention", "full"])
def test_activation_memory_is_what_the_tape_keeps(policy):
    config = LlamaConfig.from_preset(
        "tiny", hidden_size=64, intermediate_size=176, vocab_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    b, s = 2, 32
    cost = llama_cost(config, s)
    predicted = (
        plan_search.estimate(cost, MACHINE, b, 1, 1, 1, 0, policy, 1).memory
        - cost.params * plan_search.FP32.total
    )
    lf.seed(0)
    model = LlamaForCausalLM(config)
    apply_recompute(ParallelPlan.make("llama", recompute=policy), model)
    ids = lf.tensor(np.random.default_rng(0).integers(0, 512, (b, s)))
    measured = saved_bytes([model.loss(ids, ids)])
    assert predicted == pytest.approx(measured, rel=0.01)


def test_a_pipeline_holds_the_schedules_in_flight_micro_batches():
    cost = toy()  # 4 layers on 4 stages: the fullest stage holds a layer and the head
    state = (cost.layer_params + max(cost.edge_params)) * plan_search.FP32.total
    one = plan_search.estimate(cost, MACHINE, 32, 1, 1, 4, 0, "none", 8, "1f1b")
    fthenb = plan_search.estimate(cost, MACHINE, 32, 1, 1, 4, 0, "none", 8, "fthenb")
    # the textbook counts: 1F1B's first stage holds pp = 4 micro-batches, FThenB all 8
    micro = (one.memory - state) / 4
    assert micro > 0 and fthenb.memory - state == pytest.approx(8 * micro)
    assert one.parts["bubble"] > 0 and fthenb.step == pytest.approx(one.step)


def test_one_rank_gets_the_plain_single_process_plan():
    choice = plan_search.plan(toy(), MACHINE, 1, 8, mem=1e12)
    best = choice.best
    assert (best.dp, best.tp, best.pp, best.zero, best.recompute, best.micro_batches) == (
        1,
        1,
        1,
        0,
        "none",
        1,
    )


@settings(max_examples=40, deadline=None)
@given(
    world=st.sampled_from([1, 2, 4, 6, 8, 16]),
    params=st.floats(1e5, 1e8),
    act=st.floats(10, 1e5),
    mem_fraction=st.floats(0.01, 2.0),
)
def test_the_choice_fits_and_nothing_that_fits_is_faster(world, params, act, mem_fraction):
    cost = toy(params, layers=8, act=act)
    pool = plan_search.candidates(cost, MACHINE, world, 16, schedules=("1f1b", "zero_bubble"))
    assert pool and all(c.dp * c.tp * c.pp == world for c in pool)
    mem = mem_fraction * max(c.memory for c in pool)
    if min(c.memory for c in pool) > mem:
        with pytest.raises(PlanError, match="no plan fits"):
            plan_search.choose(pool, mem)
        return
    choice = plan_search.choose(pool, mem)
    assert choice.best.memory <= mem
    assert all(c.step >= choice.best.step * (1 - 1e-9) for c in pool if c.memory <= mem)


def test_nothing_fits_names_the_smallest_memory_needed():
    pool = plan_search.candidates(toy(1e8), MACHINE, 4, 16)
    small = min(pool, key=lambda c: c.memory)
    with pytest.raises(PlanError) as info:
        plan_search.choose(pool, small.memory * 0.99)
    assert f"the smallest, {small.label}, needs {small.memory / 1e9:.3g} GB per rank" in str(info.value)


def test_64_ranks_enumerate_every_layout():
    cost = llama_cost(LlamaConfig.from_preset("7B"), 4096, 2)
    pool = plan_search.candidates(
        cost,
        plan_search.gpu_machine("H100"),
        64,
        512,
        precision=plan_search.MIXED,
        schedules=("1f1b", "zero_bubble"),
    )
    layouts = {(c.dp, c.tp, c.pp) for c in pool}
    assert all(dp * tp * pp == 64 and tp <= 8 for dp, tp, pp in layouts)
    assert {(64, 1, 1), (8, 8, 1), (8, 1, 8), (2, 4, 8)} <= layouts
    choice = plan_search.choose(pool, 80e9)
    assert choice.best.memory <= 80e9 and "chose" in choice.reasons()[0]


def test_llmkit_plan_prints_the_table_and_the_choice(tmp_path, capsys):
    from llmkit.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model: {preset: 7B}\ntokenizer: {vocab_size: 4096}\n"
        "train: {batch_size: 64, seq_len: 4096}\nout_dir: x\n"
    )
    assert main(["plan", str(cfg), "--world", "8", "--mem-gb", "80", "--gpu", "H100", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "8 ranks of 80 GB on H100" in out and "plans fit" in out and "\nchose dp" in out
    assert "run it: llmkit train" in out and "'parallel={dp:" in out
    assert "MFU is predicted, not measured: the model runs matmuls at 70% of the published peak" in out
    assert "no plan can show more than 70%" in out
    assert main(["plan", str(cfg), "--world", "8", "--mem-gb", "1", "--gpu", "H100"]) == 2
    assert "no plan fits in 1 GB per rank: the smallest" in capsys.readouterr().err
    for mem in ("-5", "0"):
        assert main(["plan", str(cfg), "--world", "8", "--mem-gb", mem, "--gpu", "H100"]) == 2
        err = capsys.readouterr().err
        assert f"--mem-gb must be above 0, got {float(mem):g}" in err and "Traceback" not in err


def test_predicted_mfu_never_exceeds_the_assumed_matmul_efficiency():
    """The GPU model runs matmuls at EFFICIENCY of the peak and adds only costs on top, so its MFU
    is bounded by it (what ``llmkit plan`` says under its table)."""
    cost = llama_cost(LlamaConfig.from_preset("7B"), 4096, 2)
    gpu = plan_search.gpu_machine("A100")
    choice = plan_search.plan(cost, gpu, 64, 1024, 80e9, precision=plan_search.MIXED)
    values = [plan_search.mfu(c, cost, gpu, 1024) for c in choice.ranked]
    assert 0.3 < max(values) <= plan_search.EFFICIENCY
