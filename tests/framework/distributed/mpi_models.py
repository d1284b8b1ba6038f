"""Checks for ``mpiexec -n 2|4`` (run by mpi_checks.py): the Llama decoder block (llama_block.py)
under each plan that fits the world, eager and static (partitioned per rank, run by the executor),
in float32 against the plain float32 block computed on each process, to 1e-6; the tensor-parallel
MLP's static program (compiled) too."""

from __future__ import annotations

import numpy as np
from llama_block import PLANS, distributed, plain

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework.jit import to_static


def close(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(
            g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max(), err_msg=f"{what}: output {i}"
        )


def tp_mlp() -> None:
    mesh = dist.ProcessMesh((2,), ["tp"])
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((5, 8), (6, 8), (8, 6)))
    W1 = dist.shard_tensor(lf.Parameter(w1), mesh, ["S(0)"])
    W2 = dist.shard_tensor(lf.Parameter(w2), mesh, ["S(1)"])

    def step(x):
        y = dist.reshard(lf.ops.linear(lf.ops.silu(lf.ops.linear(x, W1)), W2), mesh, ["R"])
        loss = (y * y).sum()
        gx, g1, g2 = lf.grad(loss, [x, W1, W2])
        return loss, dist.reshard(gx, mesh, ["R"]), g1, g2

    X = dist.shard_tensor(lf.tensor(x, requires_grad=True), mesh, ["R"])
    got = [dist.unshard(o).numpy() for o in to_static(step)(X)]  # compiled: fused around the collectives
    xp, w1p, w2p = (lf.tensor(a, requires_grad=True) for a in (x, w1, w2))
    loss = (lf.ops.linear(lf.ops.silu(lf.ops.linear(xp, w1p)), w2p) ** 2).sum()
    close(got, [o.numpy() for o in (loss, *lf.grad(loss, [xp, w1p, w2p]))], "tp mlp")


def run() -> int:
    """Every check; returns how many ran."""
    world = dist.get_world_size()
    want = plain("float32")
    n = 0
    for plan, (shape, *_rest) in sorted(PLANS.items()):
        if int(np.prod(shape)) != world:
            continue
        for mode in ("eager", "static"):
            close(distributed(plan, mode, "float32"), want, f"{plan} {mode}")
            n += 1
    tp_mlp()
    return n + 1
