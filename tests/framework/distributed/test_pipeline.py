"""Pipeline parallelism on ``sim`` (one thread per rank): every schedule's 20-step losses equal
the single-process run (pp=2, and pp=2 x dp=2 on 4 ranks), a tied embedding split over the first
and last stage, the global-view layout (distributed tensors on each stage's ranks); the memory a
run holds is the schedule's; stages from layer ranges or balanced by cost. Static stages and a
tied embedding over MPI close the file (every schedule over MPI: tests/train/test_pipeline_mpi.py)."""

from __future__ import annotations

import itertools
import shutil

import numpy as np
import pytest
from dist_helpers import run_mpi
from pipeline_runs import SCHEDULES, GlobalView, batches, model, pipelined, single, worst

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework.autograd import accumulate_deferred, run_backward
from llmkit.framework.distributed.pipeline import Pipeline, PipelineError, balance, parse_stages
from llmkit.models.llama.pipeline_parts import pipeline_parts

REL = 1e-5


@pytest.fixture(scope="module")
def reference():
    dist.init("sim", world_size=max(4, dist.get_world_size()))
    return batches(), single()


@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_pp2_losses_equal_the_single_process_run(reference, name, mode):
    data, want = reference
    got = pipelined(name, 2, data=data, mode=mode)
    assert worst(got[0], want) <= REL and got[0] == got[1]  # every rank reports the loss


def test_compiled_stage_programs():
    """Static stages compiled by CINN (fused C kernels) give the same losses as uncompiled ones."""
    data = batches()[:5]
    pipe = Pipeline.build(pipeline_parts(model(), 16), dist.ProcessMesh((2,), ["pp"]), "zero_bubble", 4)
    x, y = data[0]

    def body(r):
        rp = pipe.for_rank(r, mode="static", compiler="cinn")
        loss = rp.step(x, y)
        steps = [[s.name for s in ex.steps] for ex, _, _ in rp.runners[r].phases]  # F, B, W
        assert len(steps) == 3 and all(any("cinn.fusion" in n for n in steps[k]) for k in (0, 2))
        return loss, {n: p.grad.numpy() for n, p in rp.layers.named_parameters()}

    got = dist.run_ranks(range(2), body)
    plain = dist.run_ranks(range(2), lambda r: _eager_step(pipe, r, x, y))
    assert got[0][0] == pytest.approx(plain[0][0], rel=1e-6)
    for r in range(2):
        for n, g in got[r][1].items():
            np.testing.assert_allclose(g, plain[r][1][n], rtol=2e-5, atol=1e-7, err_msg=n)


def _eager_step(pipe, r, x, y):
    rp = pipe.for_rank(r)
    loss = rp.step(x, y)
    return loss, {n: p.grad.numpy() for n, p in rp.layers.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_pp2_x_dp2_losses_equal_the_single_process_run(reference, name, mode):
    data, want = reference
    got = pipelined(name, 2, 2, data=data, mode=mode)
    assert max(worst(g, want) for g in got.values()) <= REL


def test_a_tied_embedding_on_the_first_and_last_stage():
    """The first stage embeds with it and the last projects with it: both hold a copy, their
    gradients are summed and the norm counts it once, so the copies stay equal."""
    data = batches()
    want = single(data, tie_word_embeddings=True)
    got = pipelined("1f1b", 2, data=data, tie_word_embeddings=True)
    assert worst(got[0], want) <= REL


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_a_global_view_layout_on_each_stage(mode):
    """Stages held as distributed tensors on their dp ranks (the kind of layout tp and ZeRO plans
    give): activations cross between stages shard by shard; static stages are partitioned per
    rank, then split into their jobs' programs."""
    data = batches()[:5]  # warmup steps: the same learning rates as the 20-step reference
    want = single(batches())[:5]
    got = pipelined("1f1b", 2, 2, data=data, layout=GlobalView, mode=mode)
    assert max(worst(g, want) for g in got.values()) <= REL


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_rank_holds_what_its_schedule_says(name):
    """The activations a rank keeps between its forward and its last backward job peak at the
    schedule's in-flight count (1F1B: pp - rank, not the micro-batch count)."""
    m, v = SCHEDULES[name]
    pipe = Pipeline.build(pipeline_parts(model(), 16), dist.ProcessMesh((2,), ["pp"]), name, m, v)
    x, y = batches(1)[0]

    def body(r):
        rp = pipe.for_rank(r)
        rp.step(x, y)
        return rp.peak_held

    peaks = dist.run_ranks(range(2), body)
    assert peaks == {r: pipe.schedule.in_flight(r) for r in range(2)}


def test_split_backward_defers_weight_gradients():
    """autograd's defer: the input gradient now, the weights' later, summing to the same."""
    rng = np.random.default_rng(0)
    w = lf.Parameter(rng.standard_normal((3, 4)))
    x = lf.tensor(rng.standard_normal((2, 4)), requires_grad=True)
    y = lf.ops.linear(lf.ops.silu(lf.ops.linear(x, w)), w.T)
    got = run_backward([y], [lf.ones_like(y)], defer=lambda t: t is w)
    assert w.grad is None and x.grad is not None and got
    accumulate_deferred(got)
    # float64 by hand: y = silu(a) w with a = x w^T and L = sum(y), so with ga = dL/da
    # = (1 w^T) * silu'(a): dL/dw = ga^T x + silu(a)^T 1 and dL/dx = ga w
    xa, wa = x.numpy(), w.numpy()
    a = xa @ wa.T
    s = 1 / (1 + np.exp(-a))
    ga = (np.ones((2, 4)) @ wa.T) * (s * (1 + a * (1 - s)))
    np.testing.assert_allclose(w.grad.numpy(), ga.T @ xa + (a * s).T @ np.ones((2, 4)), rtol=1e-10)
    np.testing.assert_allclose(x.grad.numpy(), ga @ wa, rtol=1e-10)


def test_stages_from_layer_ranges():
    assert parse_stages(["0-1", "2-3"], 4, 2) == (range(0, 2), range(2, 4))
    assert parse_stages([0, "1-3"], 4, 2) == (range(0, 1), range(1, 4))
    for spec, n, match in [
        (["0-1"], 2, r"pp_stages: 1 ranges for 2 stages"),
        (["0-1", "3-3"], 2, r"pp_stages\[1\]: '3-3' should start at layer 2"),
        (["0-1", "2-2"], 2, r"the ranges cover layers 0-2; the model has 4"),
        (["0-1", "2 to 3"], 2, r"pp_stages\[1\]: '2 to 3' is not a layer range"),
    ]:
        with pytest.raises(PipelineError, match=match):
            parse_stages(spec, 4, n)


@pytest.mark.parametrize("seed", range(6))
def test_balanced_stages_minimize_the_costliest_stage(seed):
    """Against every way of cutting the blocks (brute force)."""
    rng = np.random.default_rng(seed)
    costs = rng.uniform(1, 5, 7).tolist()
    head, tail = rng.uniform(0, 6, 2)
    for k in (1, 2, 3, 4):
        got = balance(costs, k, head, tail)
        assert [r.start for r in got] == sorted(r.start for r in got) and got[-1].stop == 7

        def worst_of(cuts):
            bounds = [0, *cuts, 7]
            sums = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
            sums[0] += head
            sums[-1] += tail
            return max(sums)

        best = min(worst_of(c) for c in itertools.combinations(range(1, 7), k - 1))
        assert worst_of([r.start for r in got[1:]]) == pytest.approx(best)


def test_llama_stages_balance_the_head_against_the_layers():
    """A large vocabulary makes the last piece cost several layers: the last stage gets fewer."""
    parts = pipeline_parts(model(vocab_size=4096, num_hidden_layers=8), 16)
    pipe = Pipeline.build(parts, dist.ProcessMesh((2,), ["pp"]))
    assert len(pipe.stages[0]) > len(pipe.stages[1])
    assert "stage 1 (pp 1): layers" in pipe.describe() and "+ last" in pipe.describe()
    with pytest.raises(PipelineError, match="8 stages need at least as many layers; the model has 4"):
        Pipeline.build(pipeline_parts(model(), 16), dist.ProcessMesh((4,), ["pp"]), "interleaved", 4, 2)
    with pytest.raises(PipelineError, match="has no 'pp' dim"):
        Pipeline.build(pipeline_parts(model(), 16), dist.ProcessMesh((2,), ["dp"]))


def test_a_batch_that_does_not_cut_into_micro_batches():
    pipe = Pipeline.build(pipeline_parts(model(), 16), dist.ProcessMesh((2,), ["pp"]), "1f1b", 3)
    x, y = batches(1)[0]
    with pytest.raises(PipelineError, match="a batch of 8 rows cannot be cut into 3 equal micro-batches"):
        dist.run_ranks(range(2), lambda r: pipe.for_rank(r).step(x, y))


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the dist extra's openmpi)")
def test_pipeline_losses_over_mpi():
    """mpi_pipeline.py: static 1f1b stages and a tied embedding over 2 processes, each rank against
    the single-process run (every schedule over MPI: tests/train/test_pipeline_mpi.py)."""
    proc = run_mpi("mpi_pipeline.py", 2, timeout=400)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "ok 2", proc.stdout
