"""Meshes, placements, shard_tensor / unshard / from_local and every reshard transition on ``sim``,
checked against the independent layout reference in dist_helpers.py (uneven splits, 2-D meshes,
one tensor dim over two mesh dims, moves between meshes, the thread rendezvous, timeouts)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from dist_helpers import coords, make_locals, ref_global, ref_local

import llmkit.framework.distributed as dist
from llmkit.framework.distributed.reshard import plan
from llmkit.framework.placement import chunk_sizes

R, S, P = dist.Replicate, dist.Shard, dist.Partial


@pytest.fixture(autouse=True, scope="module")
def sim():
    dist.init("sim")


# ---- meshes and placements ------------------------------------------------------------------------


def test_mesh_construction_slicing_and_groups():
    m = dist.ProcessMesh((2, 3), ["dp", "tp"])
    assert m.shape == (2, 3) and m.ranks == (0, 1, 2, 3, 4, 5) and m.size() == 6 and m.size("tp") == 3
    assert m.coord(4) == (1, 1) and m.group(4, "tp") == (3, 4, 5) and m.group(4, "dp") == (1, 4)
    assert m.groups("dp") == [(0, 3), (1, 4), (2, 5)]
    assert m["dp", 1] == dist.ProcessMesh((3,), ["tp"], ranks=[3, 4, 5]) == m[1]
    assert m["tp", 2].ranks == (2, 5) and m["tp", 2].dim_names == ("dp",)
    assert m[:, 1:].shape == (2, 2) and m[:, 1:].ranks == (1, 2, 4, 5)
    nested = dist.ProcessMesh([[4, 5], [6, 7]], ["a", "b"])
    assert nested.ranks == (4, 5, 6, 7) and nested.coord(6) == (1, 0)
    assert hash(nested) == hash(dist.ProcessMesh((2, 2), ["a", "b"], ranks=[4, 5, 6, 7]))
    assert repr(m) == "ProcessMesh([2, 3], ['dp', 'tp'])"
    for bad, msg in [
        (lambda: dist.ProcessMesh([[0, 0]]), "distinct"),
        (lambda: dist.ProcessMesh((2, 2), ["a"]), "dim names"),
        (lambda: dist.ProcessMesh((0,)), "at least one rank"),
        (lambda: m["pp", 0], "no dim 'pp'"),
        (lambda: m.coord(9), "not in"),
    ]:
        with pytest.raises((ValueError, KeyError), match=msg):
            bad()


def test_placements_are_frozen_printable_values():
    assert (R(), S(1), P()) == (
        dist.Placement.parse("R"),
        dist.Placement.parse("S(1)"),
        dist.Placement.parse("P"),
    )
    assert (
        dist.Placement.parse("P(max)") == P("max") and str(P("avg")) == "P(avg)" and repr(S(0)) == "Shard(0)"
    )
    assert len({S(0), S(0), R(), R()}) == 2
    with pytest.raises(AttributeError):
        S(0).dim = 1
    for bad in ("Q", "S", "S(x)", "P(prod)", "R(1)"):
        with pytest.raises(ValueError):
            dist.Placement.parse(bad)
    m = dist.ProcessMesh((2,))
    with pytest.raises(ValueError, match="one per mesh dim"):
        dist.shard_tensor(np.zeros(4), m, [R(), R()])
    with pytest.raises(ValueError, match="out of range"):
        dist.shard_tensor(np.zeros(4), m, [S(1)])
    with pytest.raises(ValueError, match="outside the world"):
        dist.shard_tensor(np.zeros(4), dist.ProcessMesh((2,), ranks=[7, 8]), [R()])


# ---- shard_tensor and unshard -----------------------------------------------------------------------

MESHES = [(3,), (2, 2), (2, 3)]
SHAPES = [(5, 7), (2, 3), (7,)]


def _all_placements(mesh_ndim, ndim, partial=("sum",)):
    one = [R()] + [S(d) for d in range(ndim)] + [P(op) for op in partial]
    return [
        ps
        for ps in itertools.product(one, repeat=mesh_ndim)
        if len({p.reduce for p in ps if p.is_partial()}) < 2
    ]


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_shard_tensor_holds_the_reference_chunks(mesh_shape):
    mesh = dist.ProcessMesh(mesh_shape)
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        g = rng.standard_normal(shape)
        for ps in _all_placements(len(mesh_shape), len(shape)):
            t = dist.shard_tensor(g, mesh, ps)
            assert t.shape == shape and t.placements == ps and t.mesh == mesh
            locs = {mesh.coord(r): s.numpy() for r, s in dist.local_shards(t).items()}
            for c, loc in locs.items():
                if not any(p.is_partial() for p in ps):
                    np.testing.assert_array_equal(loc, ref_local(g, mesh_shape, ps, c))
            np.testing.assert_array_equal(ref_global(locs, shape, mesh_shape, ps), g)
            np.testing.assert_array_equal(dist.unshard(t).numpy(), g)


def test_uneven_shards_have_real_shapes_never_padding():
    mesh = dist.ProcessMesh((2, 2), ["a", "b"])
    t = dist.shard_tensor(np.arange(5.0), mesh, [S(0), S(0)])  # 5 -> (3, 2) -> (2, 1), (1, 1)
    assert {r: s.shape for r, s in dist.local_shards(t).items()} == {0: (2,), 1: (1,), 2: (1,), 3: (1,)}
    t = dist.shard_tensor(np.arange(2.0), dist.ProcessMesh((3,)), [S(0)])  # a rank may hold nothing
    assert [s.shape for s in dist.local_shards(t).values()] == [(1,), (1,), (0,)]
    assert chunk_sizes(7, 3) == (3, 2, 2)


def test_from_local_and_tensor_accessors():
    mesh = dist.ProcessMesh((2,), ["tp"])
    t = dist.from_local({0: np.ones((2, 3)), 1: np.zeros((1, 3))}, mesh, [S(0)], shape=(3, 3))
    assert t.shape == (3, 3) and t.mesh == mesh and t.placements == (S(0),)
    np.testing.assert_array_equal(dist.unshard(t).numpy(), [[1, 1, 1], [1, 1, 1], [0, 0, 0]])
    with pytest.raises(AssertionError, match="rank 1"):  # shapes that contradict the placements
        dist.from_local({0: np.ones((2, 3)), 1: np.zeros((2, 3))}, mesh, [S(0)], shape=(3, 3))
    with pytest.raises(ValueError, match="local_shards"):
        t.local()
    plain = dist.shard_tensor(np.ones(3), mesh, [R()])
    assert plain.mesh is not None and lf_tensor_plain().mesh is None


def lf_tensor_plain():
    import llmkit.framework as lf

    return lf.tensor([1.0])


# ---- every transition --------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape,shape", [((3,), (5, 4)), ((2, 2), (5, 3)), ((2, 3), (4, 7))])
def test_every_reshard_transition(mesh_shape, shape):
    """All pairs of placements (R, S(0), S(1), P(sum) per mesh dim; P(max)/P(avg) too on 1-D):
    the result stands for the same global value, and each rank holds its reference chunk."""
    mesh = dist.ProcessMesh(mesh_shape)
    partial = ("sum", "max", "avg") if len(mesh_shape) == 1 else ("sum",)
    rng = np.random.default_rng(1)
    placements = _all_placements(len(mesh_shape), len(shape), partial)
    for src in placements:
        locs, g = make_locals(rng, shape, mesh_shape, src)
        x = dist.from_local(
            {mesh.ranks[i]: locs[c] for i, c in enumerate(coords(mesh_shape))}, mesh, src, shape
        )
        for dst in placements:
            y = dist.reshard(x, mesh, dst)
            y._data.check()
            got = {mesh.coord(r): s.numpy() for r, s in dist.local_shards(y).items()}
            np.testing.assert_allclose(
                ref_global(got, shape, mesh_shape, dst), g, rtol=1e-15, err_msg=f"{src}->{dst}"
            )


def test_plan_takes_cheap_steps_first():
    kinds = lambda a, b: [(s.kind, s.dim) for s in plan(a, b)]
    assert kinds([P(), R()], [R(), S(0)]) == [("slice", 1), ("all_reduce", 0)]  # reduce half the data
    assert kinds([R(), R()], [S(0), S(0)]) == [("slice", 0), ("slice", 1)]  # no gather on the way
    assert kinds([S(0), S(0)], [R(), R()]) == [("all_gather", 1), ("all_gather", 0)]  # inner first
    assert kinds([P(), R()], [S(0), R()]) == [("reduce_scatter", 0)]
    assert kinds([S(0), R()], [S(1), R()]) == [("all_to_all", 0)]
    assert kinds([S(0), P()], [R(), S(0)]) == [("all_gather", 0), ("reduce_scatter", 1)]
    # S(0) on mesh dim 0 is blocked by S(0) on mesh dim 1: gather the inner one first
    assert kinds([S(0), S(0)], [S(1), S(0)]) == [("all_gather", 1), ("all_to_all", 0), ("slice", 1)]
    assert kinds([S(0)], [P("max")]) == [("all_gather", 0), ("to_partial", 0)]


def test_moves_between_meshes():
    a = dist.ProcessMesh((2, 2), ["x", "y"])
    b = dist.ProcessMesh((2, 2), ["x", "y"], ranks=[4, 5, 6, 7])
    c = dist.ProcessMesh((3,), ["z"], ranks=[5, 6, 7])
    g = np.arange(35.0).reshape(5, 7)
    t = dist.shard_tensor(g, a, [S(0), S(1)])
    for mesh, ps in [(b, [S(1), R()]), (c, [S(0)]), (c, [P()]), (a, [R(), S(0)])]:
        u = dist.reshard(t, mesh, ps)
        assert u.mesh == mesh and sorted(dist.local_shards(u)) == sorted(mesh.ranks)
        got = {mesh.coord(r): s.numpy() for r, s in dist.local_shards(u).items()}
        np.testing.assert_array_equal(ref_global(got, g.shape, mesh.shape, u.placements), g)


# ---- threads: one rank per thread ----------------------------------------------------------------


def test_threads_meet_at_a_rendezvous_bit_identical_to_eager():
    mesh = dist.ProcessMesh((2, 2))
    rng = np.random.default_rng(2)
    locs = {r: rng.standard_normal((3, 5)) for r in mesh.ranks}  # not integers: the order matters
    eager = dist.reshard(dist.from_local(locs, mesh, [P(), S(1)], (3, 10)), mesh, [S(0), R()])

    def rank_fn(r):
        x = dist.from_local({r: locs[r]}, mesh, [P(), S(1)], (3, 10))
        assert dist.get_rank() == r
        return dist.local_shards(dist.reshard(x, mesh, [S(0), R()]))[r].numpy()

    threaded = dist.run_ranks(mesh.ranks, rank_fn)
    for r, s in dist.local_shards(eager).items():
        assert np.array_equal(threaded[r], s.numpy())


def test_a_rank_that_skips_a_collective_times_out_with_a_clear_error():
    mesh = dist.ProcessMesh((2,), ["tp"])

    def rank_fn(r):
        x = dist.from_local({r: np.ones(2)}, mesh, [P()], (2,))
        if r == 0:
            dist.reshard(x, mesh, [R()])

    with dist.timeout(0.3), pytest.raises(dist.CollectiveError, match=r"all_reduce.*waiting for ranks \[1\]"):
        dist.run_ranks(mesh.ranks, rank_fn)
