"""A Llama decoder block's forward and gradients under data, Megatron tensor, sequence and
dp x tp parallel plans on ``sim`` (eager and static) equal the plain float64 block to 1e-12.
The same checks run over MPI in test_dist_mpi.py (float32). Under the built-in ``llama`` plan the
block communicates exactly as Megatron-LM does (golden: the per-rank program's collectives, and
the same ones counted at the backend in eager mode)."""

from __future__ import annotations

import numpy as np
import pytest
from llama_block import CONFIG, PLANS, B, T, distributed, plain, planned

import llmkit.framework.distributed as dist
from llmkit.framework.jit import to_static


@pytest.fixture(scope="module")
def want():
    dist.init("sim")
    return plain("float64")


@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_llama_block_under_each_plan_equals_the_plain_block(plan, mode, want):
    got = distributed(plan, mode, "float64")
    names = ["output", "input grad"] + [f"param grad {i}" for i in range(len(want) - 2)]
    for name, g, w in zip(names, got, want):
        np.testing.assert_allclose(
            g, w, rtol=1e-12, atol=1e-12 * np.abs(w).max(), err_msg=f"{plan} {mode}: {name}"
        )


def _megatron(sp: bool) -> list[tuple[str, tuple]]:
    """Megatron-LM's collectives of one block on tp=2 (Shoeybi et al. 2019, fig. 4; with sequence
    parallelism Korthikanti et al. 2022, fig. 6): forward, an all-reduce after each row-parallel
    product (o_proj, down_proj), backward the two matching ones (the column-parallel inputs'
    gradients); with sp each is a reduce-scatter after the row-parallel product and an all-gather
    before the column-parallel ones (forward; the reverse in the backward). As (kind, rank's
    input shape)."""
    h = CONFIG["hidden_size"]
    whole, half = (B, T, h), (B, T // 2, h)
    if not sp:
        return [("all_reduce", whole)] * 4
    return [("all_gather", half), ("reduce_scatter", whole)] * 4


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_planned_block_equals_the_plain_block_and_communicates_as_megatron_eagerly(sp, want, monkeypatch):
    seen = []
    backend = dist.get_backend()
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        real = getattr(backend, kind)

        def spy(group, xs, *a, _real=real, _kind=kind, **k):
            if len(group) > 1:
                seen.append((_kind, tuple(next(iter(xs.values())).shape)))
            return _real(group, xs, *a, **k)

        monkeypatch.setattr(backend, kind, spy)
    fn, args, _ = planned(sp)
    outs = fn(*args)
    assert seen == _megatron(sp)
    for i, (g, w) in enumerate(zip([dist.unshard(o).numpy() for o in outs], want)):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12 * np.abs(w).max(), err_msg=f"output {i}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_planned_block_rank_program_has_megatrons_collectives(sp, want):
    fn, args, layer = planned(sp)
    f = to_static(fn, compiler="none")
    outs = f(*args)
    cp = f.get_concrete_program(*args)
    func = cp.executor.rank_program(1).function()
    collectives = [op for op in func.body if op.name.startswith("dist.")]
    assert [(op.name[5:], tuple(op.results[0].type.shape)) for op in collectives] == [
        (k, (B, T // 2 if k == "reduce_scatter" else T, CONFIG["hidden_size"])) for k, _ in _megatron(sp)
    ]
    # the forward's reductions right after the row-parallel products, on their local partial sums
    weights = {id(t): func.args[cp.n_args + i] for i, t in enumerate(cp.captures)}
    reductions = [op for op in collectives if op.name in ("dist.all_reduce", "dist.reduce_scatter")]
    for op, proj in zip(reductions, (layer.self_attn.o_proj, layer.mlp.down_proj)):
        product = op.operands[0].owner
        assert product.name == "llm.linear" and product.operands[1] is weights[id(proj.weight)]
    for i, (g, w) in enumerate(zip([dist.unshard(o).numpy() for o in outs], want)):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12 * np.abs(w).max(), err_msg=f"output {i}")
