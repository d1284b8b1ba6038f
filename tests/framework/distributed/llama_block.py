"""A Llama decoder block under the parallel plans of issue 18, shared by the sim tests and the MPI
check script: the block's forward output and the gradients of a weighted sum of it (input and every
parameter), run plain on one device and distributed (eager, or to_static partitioned per rank).

Plans (placements per mesh dim):
- ``dp``: the batch sharded, every parameter replicated;
- ``tp``: Megatron tensor parallel: q/k/v/gate/up column parallel (weights S(0)), o/down row
  parallel (S(1)), norms replicated, activations replicated;
- ``sp``: ``tp`` with the activations' sequence dim sharded between the parallel regions;
- ``dp_tp``: ``dp`` x ``tp`` on a 2x2 mesh.

:func:`planned` lays the block out with the built-in ``llama`` ParallelPlan instead (tp=2, with or
without sequence parallelism): the plan's placements and its output reshards, as training uses them.
"""

from __future__ import annotations

import numpy as np

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework import nn
from llmkit.framework.distributed.parallel_plan import ParallelPlan
from llmkit.framework.distributed.parallelize import Parallelized
from llmkit.framework.jit import to_static
from llmkit.models.llama.config import LlamaConfig
from llmkit.models.llama.model import LlamaDecoderLayer

R, S = dist.Replicate(), dist.Shard

CONFIG = dict(
    hidden_size=16,
    intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    vocab_size=32,
    num_hidden_layers=1,
)
B, T = 4, 6

_TP = {
    "q_proj": S(0),
    "k_proj": S(0),
    "v_proj": S(0),
    "gate_proj": S(0),
    "up_proj": S(0),
    "o_proj": S(1),
    "down_proj": S(1),
}

# plan -> (mesh shape, dim names, activations' placements per mesh dim, tensor parallel mesh dim or None)
PLANS = {
    "dp": ((2,), ["dp"], [S(0)], None),
    "tp": ((2,), ["tp"], [R], 0),
    "sp": ((2,), ["tp"], [S(1)], 0),
    "dp_tp": ((2, 2), ["dp", "tp"], [S(0), R], 1),
}


def param_placements(name: str, ndim_mesh: int, tp_dim: int | None) -> list:
    ps = [R] * ndim_mesh
    if tp_dim is not None:
        for key, p in _TP.items():
            if f".{key}." in f".{name}":
                ps[tp_dim] = p
    return ps


def make(dtype: str, seed: int = 0):
    """A block with random weights, its RoPE tables, an input, position ids and the loss weights."""
    config = LlamaConfig(**CONFIG)
    layer = LlamaDecoderLayer(config, 0).to(dtype)
    rng = np.random.default_rng(seed)
    for _, p in layer.named_parameters():  # norms near 1, projections of a modest scale
        p.set_value(
            lf.tensor(rng.standard_normal(p.shape) * 0.3 + (1.0 if p.ndim == 1 else 0.0), dtype=dtype)
        )
    angles = np.arange(config.max_position_embeddings)[:, None] * config.rope_inv_freq()[None]
    angles = np.concatenate([angles, angles], axis=-1)
    x = rng.standard_normal((B, T, config.hidden_size)).astype(dtype)
    pos = np.tile(np.arange(T), (B, 1)).astype(np.int64)
    w = rng.standard_normal((B, T, config.hidden_size)).astype(dtype)
    return layer, np.cos(angles).astype(dtype), np.sin(angles).astype(dtype), x, pos, w


def step(layer, cos, sin):
    """forward + gradients of sum(out * w) w.r.t. the input and every parameter."""
    params = [p for _, p in layer.named_parameters()]

    def fn(x, pos, w):
        out = layer(x, cos, sin, pos)
        grads = lf.grad((out * w).sum(), [x, *params])
        return (out, *grads)

    return fn


def plain(dtype: str, seed: int = 0) -> list[np.ndarray]:
    layer, cos, sin, x, pos, w = make(dtype, seed)
    outs = step(layer, lf.tensor(cos), lf.tensor(sin))(
        lf.tensor(x, requires_grad=True), lf.tensor(pos), lf.tensor(w)
    )
    return [o.numpy() for o in outs]


def distributed(plan: str, mode: str, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """The block under ``plan`` in ``mode`` ("eager" or "static"); outputs unsharded (every rank
    calls this: it runs collectives)."""
    shape, names, act, tp_dim = PLANS[plan]
    mesh = dist.ProcessMesh(shape, names)
    layer, cos, sin, x, pos, w = make(dtype, seed)
    for name, p in layer.named_parameters():
        p._data = dist.shard_tensor(p, mesh, param_placements(name, mesh.ndim, tp_dim))._data
    rep = [R] * mesh.ndim
    pos_ps = [S(min(a.dim, 1)) if a != R else R for a in act]  # position ids [B, S] follow x's B / S
    X = dist.shard_tensor(lf.tensor(x, requires_grad=True), mesh, act)
    args = (X, dist.shard_tensor(pos, mesh, pos_ps), dist.shard_tensor(w, mesh, act))
    fn = step(layer, dist.shard_tensor(cos, mesh, rep), dist.shard_tensor(sin, mesh, rep))
    outs = fn(*args) if mode == "eager" else to_static(fn, compiler="none")(*args)
    return [dist.unshard(o).numpy() for o in outs]


class _Layers(nn.Layer):
    """The block named as in a Llama model (``layers.0.*``), so the plan's globs find it."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.layers = nn.LayerList([layer])


def planned(sp: bool, dtype: str = "float64", seed: int = 0):
    """The block under ``plan: llama`` with tp=2 (``sp``: sequence parallel): (step function, its
    distributed arguments, the block). The step returns the output, the input's gradient in the
    input's layout (as the block below takes it) and the parameters' gradients."""
    layer, cos, sin, x, pos, w = make(dtype, seed)
    par = Parallelized(_Layers(layer), ParallelPlan.make("llama", tp=2, sp=sp))
    mesh, rep = par.mesh, [R] * par.mesh.ndim
    act = [S(0), S(1) if sp else R]  # [dp, tp]: the residual stream between the tp regions
    inner = step(layer, dist.shard_tensor(cos, mesh, rep), dist.shard_tensor(sin, mesh, rep))

    def fn(x, pos, w):
        out, gx, *grads = inner(x, pos, w)
        return (out, dist.reshard(gx, mesh, act), *grads)

    X = dist.shard_tensor(lf.tensor(x, requires_grad=True), mesh, act)
    args = (X, dist.shard_tensor(pos, mesh, [S(0), R]), dist.shard_tensor(w, mesh, act))
    return fn, args, layer
