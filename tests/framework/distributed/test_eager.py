"""The distributed world in eager mode: ops on distributed tensors choose their layout from the op
table's SPMD rules, autograd gives distributed gradients (Partial until something needs them
reduced), and errors say what to do. Values are checked against the same code on plain float64
tensors (the op table's own tests check those against numpy formulas)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework.distributed import comm

R, S, P = dist.Replicate, dist.Shard, dist.Partial
O = lf.ops


@pytest.fixture(autouse=True, scope="module")
def sim():
    dist.init("sim")


@pytest.fixture
def collectives(monkeypatch):
    """Every collective the sim backend runs, as (name, shape of the first member's array)."""
    seen = []
    backend = dist.get_backend()
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        real = getattr(backend, name)

        def spy(group, xs, *a, _real=real, _name=name, **k):
            seen.append((_name, tuple(next(iter(xs.values())).shape)))
            return _real(group, xs, *a, **k)

        monkeypatch.setattr(backend, name, spy)
    return seen


def test_a_replicated_weight_gets_a_partial_gradient_until_it_is_needed():
    mesh = dist.ProcessMesh((2,), ["dp"])
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((6, 4)), rng.standard_normal((3, 4))
    xd = dist.shard_tensor(x, mesh, [S(0)])  # data parallel: the batch is sharded
    wd = dist.shard_tensor(lf.Parameter(w), mesh, [R()])
    loss = (O.linear(xd, wd) ** 2).sum()
    assert loss.placements == (P("sum"),)
    loss.backward()
    assert isinstance(wd, lf.Parameter) and wd.grad.placements == (P("sum"),)  # no all-reduce yet
    wp = lf.tensor(w, requires_grad=True)
    (O.linear(lf.tensor(x), wp) ** 2).sum().backward()
    reduced = dist.reshard(wd.grad, mesh, [R()])
    np.testing.assert_allclose(dist.local_shards(reduced)[1].numpy(), wp.grad.numpy(), rtol=1e-12)


def test_megatron_mlp_needs_one_all_reduce(collectives):
    """Column-parallel then row-parallel: the only communication is the all-reduce of the output."""
    mesh = dist.ProcessMesh((2,), ["tp"])
    rng = np.random.default_rng(1)
    x, w1, w2 = rng.standard_normal((5, 8)), rng.standard_normal((6, 8)), rng.standard_normal((8, 6))
    h = O.silu(O.linear(dist.shard_tensor(x, mesh, [R()]), dist.shard_tensor(w1, mesh, [S(0)])))
    assert h.placements == (S(1),)
    y = O.linear(h, dist.shard_tensor(w2, mesh, [S(1)]))
    assert y.placements == (P("sum"),) and collectives == []
    got = dist.unshard(y).numpy()
    want = O.linear(O.silu(O.linear(lf.tensor(x), lf.tensor(w1))), lf.tensor(w2)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert [c[0] for c in collectives] == ["all_reduce"]


def test_vocab_parallel_cross_entropy_never_gathers_the_logits(collectives):
    mesh = dist.ProcessMesh((2,), ["tp"])
    rng = np.random.default_rng(2)
    logits, labels = rng.standard_normal((4, 3, 10)), rng.integers(0, 10, (4, 3))
    labels[0, 1] = -100  # ignored
    ld = dist.shard_tensor(lf.tensor(logits, requires_grad=True), mesh, [S(2)])
    loss = O.cross_entropy(ld, dist.shard_tensor(labels, mesh, [R()]))
    lp = lf.tensor(logits, requires_grad=True)
    want = O.cross_entropy(lp, lf.tensor(labels))
    np.testing.assert_allclose(dist.unshard(loss).numpy(), want.numpy(), rtol=1e-12)
    # only per-row statistics move ([4, 3, 1]: the max, the sum of exps, the loss terms), never a
    # row of logits ([4, 3, 5] per rank)
    assert collectives and all(np.prod(shape) <= 12 for _, shape in collectives), collectives
    loss.backward()
    want.backward()
    assert ld.grad.placements == (S(2),)
    np.testing.assert_allclose(dist.unshard(ld.grad).numpy(), lp.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_vocab_parallel_embedding_is_a_partial_sum_of_masked_lookups():
    mesh = dist.ProcessMesh((3,), ["tp"])  # 10 rows over 3 ranks: 4, 3, 3
    rng = np.random.default_rng(3)
    ids, w = rng.integers(0, 10, (2, 5)), rng.standard_normal((10, 4))
    out = O.embedding(dist.shard_tensor(ids, mesh, [R()]), dist.shard_tensor(w, mesh, [S(0)]))
    assert out.placements == (P("sum"),)
    np.testing.assert_allclose(dist.unshard(out).numpy(), w[ids], rtol=1e-15)


def test_plain_tensors_and_scalars_join_as_replicated_values():
    mesh = dist.ProcessMesh((2, 2))
    x = np.arange(12.0).reshape(3, 4)
    t = dist.shard_tensor(x, mesh, [S(0), S(1)])
    y = t * 2.0 + lf.tensor(np.ones(4)) - 1
    assert y.placements == (S(0), S(1))
    np.testing.assert_array_equal(dist.unshard(y).numpy(), x * 2)


def test_errors_name_what_to_do():
    a = dist.shard_tensor(np.ones(4), dist.ProcessMesh((2,), ["x"]), [S(0)])
    b = dist.shard_tensor(np.ones(4), dist.ProcessMesh((2,), ["x"], ranks=[2, 3]), [S(0)])
    with pytest.raises(lf.ops.OpError, match="different meshes.*dist.reshard"):
        a + b
    with pytest.raises(TypeError, match=r"distributed tensor .*dist.unshard\(t\)"):
        a.numpy()
    with pytest.raises(TypeError, match="shard_tensor"):
        dist.reshard(lf.tensor([1.0]), a.mesh, [R()])
    spec = lf.ops.table()["exp"]
    rule, spec.spmd = spec.spmd, None
    try:
        with pytest.raises(lf.ops.OpError, match="exp: no SPMD rule"):
            O.exp(a)
    finally:
        spec.spmd = rule


def test_reshard_is_differentiable_and_its_gradient_keeps_the_values():
    mesh = dist.ProcessMesh((2,), ["x"])
    x = dist.shard_tensor(lf.tensor(np.arange(4.0), requires_grad=True), mesh, [S(0)])
    y = dist.reshard(x, mesh, [R()])
    (y * y).sum().backward()
    np.testing.assert_array_equal(dist.unshard(x.grad).numpy(), 2 * np.arange(4.0))


def test_reshards_gradient_takes_the_inputs_layout_with_partial_made_replicate(collectives):
    """The backward of reshard(x) lays the gradient out as x was (Megatron's f/g: the gradient of an
    all-reduced partial sum is replicated, that of an all-gather reduce-scattered back)."""
    mesh = dist.ProcessMesh((2,), ["tp"])
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    for src, dst, grad in ((P("sum"), R(), R()), (S(0), R(), S(0)), (S(1), S(0), S(1))):
        xd = dist.shard_tensor(lf.tensor(x, requires_grad=True), mesh, [src])
        y = dist.reshard(xd * 2.0, mesh, [dst])
        (y * dist.shard_tensor(w, mesh, [R()])).sum().backward()
        assert xd.grad.placements == (grad,), (src, dst)
        np.testing.assert_allclose(dist.unshard(xd.grad).numpy(), 2 * w, rtol=1e-15)
    other = dist.ProcessMesh((2,), ["tp"], ranks=[2, 3])  # moved to another mesh: the gradient comes back
    xd = dist.shard_tensor(lf.tensor(x, requires_grad=True), mesh, [S(0)])
    (dist.reshard(xd, other, [R()]) * dist.shard_tensor(w, other, [R()])).sum().backward()
    assert xd.grad.mesh == mesh and xd.grad.placements == (S(0),)
    np.testing.assert_allclose(dist.unshard(xd.grad).numpy(), w, rtol=1e-15)


def test_parameters_stay_put_and_activations_follow_them(collectives):
    """A column-parallel weight [out, in] S(0) and a batch-sharded input on the same mesh dim: the
    input is gathered (more bytes than the weight here), never the weight."""
    mesh = dist.ProcessMesh((2,), ["tp"])
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((8, 3)), rng.standard_normal((4, 3))
    wd = dist.shard_tensor(lf.Parameter(w), mesh, [S(0)])
    y = O.linear(dist.shard_tensor(x, mesh, [S(0)]), wd)
    assert y.placements == (S(1),) and collectives == [("all_gather", (4, 3))]
    np.testing.assert_allclose(dist.unshard(y).numpy(), x @ w.T, rtol=1e-14)
    plain = O.linear(dist.shard_tensor(x, mesh, [S(0)]), dist.shard_tensor(w, mesh, [S(0)]))
    assert plain.placements == (S(0),) and collectives[-1] == ("all_gather", (2, 3))  # by bytes alone


def test_vocab_parallel_embedding_gradient_stays_sharded(collectives):
    mesh = dist.ProcessMesh((3,), ["tp"])
    rng = np.random.default_rng(6)
    ids, w, g = rng.integers(0, 10, (2, 5)), rng.standard_normal((10, 4)), rng.standard_normal((2, 5, 4))
    wd = dist.shard_tensor(lf.Parameter(w), mesh, [S(0)])
    out = O.embedding(dist.shard_tensor(ids, mesh, [R()]), wd)
    (out * dist.shard_tensor(g, mesh, [R()])).sum().backward()
    assert wd.grad.placements == (S(0),) and collectives == []  # each rank adds the rows it holds
    want = np.zeros_like(w)
    np.add.at(want, ids.reshape(-1), g.reshape(-1, 4))
    np.testing.assert_allclose(dist.unshard(wd.grad).numpy(), want, rtol=1e-14)


def test_local_in_a_rank_thread():
    mesh = dist.ProcessMesh((2,), ["x"])
    t = dist.shard_tensor(np.arange(5.0), mesh, [S(0)])
    got = dist.run_ranks(
        mesh.ranks, lambda r: dist.from_local(t._data.shards[r], mesh, [S(0)], (5,)).local().numpy()
    )
    assert got[0].tolist() == [0, 1, 2] and got[1].tolist() == [3, 4]
    assert comm.get_backend().name == "sim"


def test_each_rank_thread_starts_from_the_callers_settings_and_draws_on_its_own():
    """A rank thread is a process forked from the caller: the caller's default dtype and random
    state, then a generator of its own. With one shared generator (the old code) the ranks took each
    other's numbers: rank 1's first draw continued rank 0's, and the last seed reset both."""
    both_seeded = threading.Barrier(2)

    def rank(r: int):
        start = lf.randn(3).numpy()
        lf.seed(100 + r)
        both_seeded.wait()
        return start, lf.randn(3).numpy()

    lf.set_default_dtype("float64")  # a rank thread's too (its draws are float64 ones)
    try:
        lf.seed(7)
        first = lf.randn(3).numpy()
        lf.seed(7)
        got = dist.run_ranks([0, 1], rank)
        np.testing.assert_array_equal(lf.randn(3).numpy(), first)  # the caller's draws stay its own
        for r in (0, 1):
            lf.seed(100 + r)
            np.testing.assert_array_equal(got[r][0], first)
            np.testing.assert_array_equal(got[r][1], lf.randn(3).numpy())
    finally:
        lf.set_default_dtype("float32")
