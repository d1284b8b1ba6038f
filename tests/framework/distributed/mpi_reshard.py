"""Checks for ``mpiexec -n 2|4`` (run by mpi_checks.py): shard_tensor, unshard and reshard
transitions on the mpi backend, each rank checking its own shard against the independent
reference (dist_helpers.py)."""

from __future__ import annotations

import itertools

import numpy as np
from dist_helpers import make_locals, ref_local

import llmkit.framework.distributed as dist

R, S, P = dist.Replicate, dist.Shard, dist.Partial


def placements(mesh_ndim, ndim, partial=("sum",)):
    one = [R()] + [S(d) for d in range(ndim)] + [P(op) for op in partial]
    return [
        ps
        for ps in itertools.product(one, repeat=mesh_ndim)
        if len({p.reduce for p in ps if p.is_partial()}) < 2
    ]


def check_transitions(mesh, shape, pairs, rng) -> int:
    me = dist.get_rank()
    n = 0
    for src, dst in pairs:
        locs, g = make_locals(rng, shape, mesh.shape, src)  # every rank draws the same numbers
        mine = {me: locs[mesh.coord(me)]} if me in mesh else {}
        x = dist.from_local(mine, mesh, src, shape)
        y = dist.reshard(x, mesh, dst)
        if me in mesh and not any(p.is_partial() for p in dst):
            np.testing.assert_array_equal(y.local().numpy(), ref_local(g, mesh.shape, dst, mesh.coord(me)))
        np.testing.assert_allclose(dist.unshard(y).numpy(), g, rtol=1e-15, err_msg=f"{src} -> {dst}")
        n += 1
    return n


def run() -> int:
    """Every check; returns how many ran."""
    world = dist.get_world_size()
    me = dist.get_rank()
    rng = np.random.default_rng(0)
    n = 0
    line = dist.ProcessMesh((world,), ["x"])
    ps = placements(1, 2, ("sum", "max", "avg"))
    n += check_transitions(line, (5, 3), itertools.product(ps, ps), rng)
    g = np.arange(35.0).reshape(5, 7)
    t = dist.shard_tensor(g, line, [S(1)])
    np.testing.assert_array_equal(t.local().numpy(), ref_local(g, (world,), [S(1)], (me,)))
    if world == 4:
        grid = dist.ProcessMesh((2, 2), ["dp", "tp"])
        ps = placements(2, 2)
        pairs = list(itertools.product(ps, ps))
        picked = [pairs[i] for i in np.random.default_rng(1).choice(len(pairs), 48, replace=False)]
        n += check_transitions(grid, (5, 3), picked, rng)
        # between meshes: a 2-rank mesh to the other two ranks, and to three ranks
        a = dist.ProcessMesh((2,), ["x"], ranks=[0, 1])
        for mesh, dst in [
            (dist.ProcessMesh((2,), ["x"], ranks=[2, 3]), [S(0)]),
            (dist.ProcessMesh((3,), ["x"], ranks=[1, 2, 3]), [S(1)]),
        ]:
            t = dist.shard_tensor(g, a, [S(1)])
            u = dist.reshard(t, mesh, dst)
            if me in mesh:
                np.testing.assert_array_equal(
                    u.local().numpy(), ref_local(g, mesh.shape, dst, mesh.coord(me))
                )
            np.testing.assert_array_equal(dist.unshard(u).numpy(), g)
            n += 1
    return n
