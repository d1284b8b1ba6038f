"""Static auto-parallel on ``sim``: to_static with distributed inputs, the passes (propagate, insert
and fold reshards, partition), the per-rank programs (printed, parsed back, compiled) and their run
on one thread per rank, bit-identical to eager mode and equal to plain float64 runs."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework import ir
from llmkit.framework.distributed import static
from llmkit.framework.jit import to_static

R, S, P = dist.Replicate, dist.Shard, dist.Partial
O = lf.ops


@pytest.fixture(autouse=True, scope="module")
def sim():
    dist.init("sim")


def _tp_mlp(seed=0):
    mesh = dist.ProcessMesh((2,), ["tp"])
    rng = np.random.default_rng(seed)
    x, w1, w2 = rng.standard_normal((5, 8)), rng.standard_normal((6, 8)), rng.standard_normal((8, 6))
    X = dist.shard_tensor(lf.tensor(x, requires_grad=True), mesh, [R()])
    W1 = dist.shard_tensor(lf.Parameter(w1), mesh, [S(0)])  # column parallel
    W2 = dist.shard_tensor(lf.Parameter(w2), mesh, [S(1)])  # row parallel

    def step(x):
        y = dist.reshard(O.linear(O.silu(O.linear(x, W1)), W2), mesh, [R()])
        loss = (y * y).sum()
        gx, g1, g2 = lf.grad(loss, [x, W1, W2])
        return loss, dist.reshard(gx, mesh, [R()]), g1, g2

    return mesh, step, X, (x, w1, w2)


def test_tp_mlp_rank_program_has_one_all_reduce_forward_and_its_match_backward():
    _, step, X, _ = _tp_mlp()
    f = to_static(step, compiler="none")
    f(X)
    runner = f.get_concrete_program(X).executor
    text = str(runner.rank_program(1))
    assert str(ir.parse(text)) == text  # the per-rank program prints and parses back
    ops = [line.split("=", 1)[1].split("(")[0].strip() for line in text.splitlines() if " = " in line]
    collectives = [(i, o) for i, o in enumerate(ops) if o.startswith("dist.")]
    assert [o for _, o in collectives] == ["dist.all_reduce", "dist.all_reduce"], text
    first, second = (i for i, _ in collectives)
    assert (
        ops[first - 1] == "llm.linear" and ops[first - 2] == "llm.silu"
    )  # right after the row-parallel product
    assert ops[second - 1] == "llm.matmul" and "llm.matmul" not in ops[second + 1 :]  # the input's gradient
    assert "f64[5, 3]" in text and "%capture0: f64[3, 8]" in text  # local shapes of rank 1


def test_static_equals_eager_bit_for_bit_and_the_plain_float64_run():
    mesh, step, X, (x, w1, w2) = _tp_mlp(1)
    static_out = to_static(step, compiler="none")(X)
    eager_out = step(X)
    for s, e in zip(static_out, eager_out):
        assert s.placements == e.placements
        for r in mesh.ranks:
            assert np.array_equal(dist.local_shards(s)[r].numpy(), dist.local_shards(e)[r].numpy())
    xp, w1p, w2p = (
        lf.tensor(x, requires_grad=True),
        lf.tensor(w1, requires_grad=True),
        lf.tensor(w2, requires_grad=True),
    )
    loss = (O.linear(O.silu(O.linear(xp, w1p)), w2p) ** 2).sum()
    want = [loss, *lf.grad(loss, [xp, w1p, w2p])]
    for got, w in zip(static_out, want):
        np.testing.assert_allclose(dist.unshard(got).numpy(), w.numpy(), rtol=1e-12, atol=1e-12)


def test_compiled_rank_programs_fuse_around_the_collectives():
    _, step, X, _ = _tp_mlp(2)
    got = to_static(step)(X)  # the default compiler (CINN where a C compiler exists)
    want = step(X)
    for g, w in zip(got, want):
        np.testing.assert_allclose(dist.unshard(g).numpy(), dist.unshard(w).numpy(), rtol=1e-12, atol=1e-12)


def test_data_parallel_step_keeps_weight_gradients_partial_and_updates_in_place():
    mesh = dist.ProcessMesh((2, 2), ["dp", "x"])
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((4, 3))
    W = dist.shard_tensor(lf.Parameter(w0), mesh, [R(), R()])
    data = rng.standard_normal((6, 3))

    @to_static(compiler="none")
    def train(x):
        loss = (O.linear(x, W) ** 2).mean()
        (g,) = lf.grad(loss, [W])
        W.set_value(W - 0.1 * dist.reshard(g, mesh, [R(), R()]))
        return loss, g

    _, g = train(dist.shard_tensor(data, mesh, [S(0), R()]))
    assert g.placements == (P("sum"), R())
    assert W.placements == (R(), R())
    wp = lf.tensor(w0, requires_grad=True)
    (gp,) = lf.grad((O.linear(lf.tensor(data), wp) ** 2).mean(), [wp])
    np.testing.assert_allclose(dist.unshard(W).numpy(), w0 - 0.1 * gp.numpy(), rtol=1e-12)


def _annotated(fn, *inputs):
    f = to_static(fn, compiler="none")
    f(*inputs)
    return f.get_concrete_program(*inputs).executor.program


def test_passes_fold_redundant_reshards_and_push_slicing_to_the_inputs():
    mesh = dist.ProcessMesh((2,), ["x"])
    x = dist.shard_tensor(np.arange(8.0).reshape(4, 2), mesh, [R()])

    def fn(x):
        y = O.exp(x)  # computed sharded: its consumers all want rows
        a = dist.reshard(dist.reshard(y, mesh, [S(1)]), mesh, [S(0)])  # a chain: one reshard
        b = dist.reshard(y, mesh, [S(0)])  # the same move twice: merged
        return a + b, dist.reshard(a, mesh, [S(0)])  # a no-op

    p = _annotated(fn, x)
    text = str(p)
    f = p.function()
    exp = next(op for op in f.body if op.name == "llm.exp")
    assert exp.plain_attrs["placements"] == (S(0),)  # pushed back: exp runs on row shards
    assert text.count("dist.reshard") == 1, text  # x -> S(0) before exp, nothing else
    rank = str(dist.partition(p, 1))
    assert "llm.slice(%arg0) {axes = [0], starts = [2], ends = [4]}" in rank and "dist." not in rank
    out = to_static(fn, compiler="none")(x)
    np.testing.assert_allclose(dist.unshard(out[0]).numpy(), 2 * np.exp(np.arange(8.0).reshape(4, 2)))


def test_the_verifier_checks_placements_annotations():
    _, step, X, _ = _tp_mlp()
    p = _annotated(step, X)
    text = str(p)
    assert str(ir.parse(text)) == text  # annotated global programs round-trip too
    bad = text.replace("placements = [#shard<1>]}", "placements = [#shard<1>, #replicate<>]}", 1)
    with pytest.raises(ir.ParseError, match="2 placements .* for a 1-d mesh"):
        ir.parse(bad)
    bad = text.replace("[[#replicate<>], [#shard<0>]", "[[#replicate<>], [#shard<2>]", 1)
    with pytest.raises(ir.ParseError, match="input %capture0: S\\(2\\) shards dim 2, out of range"):
        ir.parse(bad)


def test_static_programs_refuse_what_they_cannot_partition():
    a = dist.ProcessMesh((2,), ["x"])
    b = dist.ProcessMesh((2,), ["x"], ranks=[2, 3])
    x, y = dist.shard_tensor(np.ones(4), a, [S(0)]), dist.shard_tensor(np.ones(4), b, [S(0)])
    with pytest.raises(static.PartitionError, match="one mesh"):
        to_static(lambda x, y: x, compiler="none")(x, y)
    with pytest.raises(static.PartitionError, match="stay on their mesh"):
        to_static(lambda x: dist.reshard(x, b, [R()]), compiler="none")(x)
    with pytest.raises(static.PartitionError, match="static shapes"):
        to_static(lambda x: x * 2, input_spec=[lf.jit.InputSpec(["N"], "float32")], compiler="none")(
            dist.shard_tensor(np.ones(4, np.float32), a, [S(0)])
        )


def test_the_examples_of_docs_parallel_md_run(capsys):
    from dist_helpers import ROOT

    text = (ROOT / "docs" / "parallel.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    scope: dict = {}
    for b in blocks:
        exec(compile(b, "docs/parallel.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "(Partial('sum'),)" in out and "(Shard(0),) (Shard(1),)" in out
    assert "dist.all_reduce(%2) {group = [0, 1]" in out and "%capture0: f64[8, 8]" in out


def test_rank_programs_lower_multi_step_reshards_on_a_2d_mesh_like_eager():
    """One tensor dim over both mesh dims, uneven (7 rows: 4 + 3, then 2 + 2 and 2 + 1), moved to
    [R, S(1)]: the per-rank programs' collectives give the eager reshard's shards exactly."""
    mesh = dist.ProcessMesh((2, 2), ["a", "b"])
    x = dist.shard_tensor(np.arange(35.0).reshape(7, 5), mesh, [S(0), S(0)])

    def fn(x):
        return dist.reshard(O.exp(x), mesh, [R(), S(1)]), dist.reshard(x * 2.0, mesh, [P(), R()])

    got, want = to_static(fn, compiler="none")(x), fn(x)
    for g, w in zip(got, want):
        assert g.placements == w.placements
        for r in mesh.ranks:
            assert np.array_equal(dist.local_shards(g)[r].numpy(), dist.local_shards(w)[r].numpy())
