"""The runs the pipeline tests compare (on ``sim`` threads and over MPI, mpi_pipeline.py): a
4-layer width-32 Llama trained 20 steps (AdamW, warmup-cosine, clipping at 1.0) on sequences of
arithmetic progressions, once in one process and once as a pipeline; plus the data-parallel layout
the pp x dp runs give each stage (every weight replicated on the stage's ranks, the batch rows
sharded, gradients all-reduced)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework import optim
from llmkit.framework.distributed.pipeline import Pipeline, mesh_value
from llmkit.framework.nn.layer import replace_payload
from llmkit.models.llama import PRESETS, LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.pipeline_parts import pipeline_parts

V, B, S, STEPS = 97, 8, 16, 20
CONFIG = dict(
    PRESETS["tiny"],
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
# (schedule, micro-batches, virtual stages) per schedule name
SCHEDULES = {"fthenb": (4, 1), "1f1b": (4, 1), "interleaved": (4, 2), "zero_bubble": (4, 1)}


def batches(steps: int = STEPS) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows ``a, a + d, a + 2d, ...`` mod V (learnable: the loss falls), inputs and next tokens."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        start, step = rng.integers(0, V, (B, 1)), rng.integers(1, 4, (B, 1))
        seq = (start + step * np.arange(S + 1)) % V
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def model(**overrides: Any) -> LlamaForCausalLM:
    lf.seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**CONFIG, **overrides}))


def train(params: list, step: Callable, clip: Callable, data) -> list[float]:
    """20 optimizer steps: ``step(x, y)`` runs forward and backward and returns the loss."""
    opt = optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = optim.WarmupCosine(opt, 5, len(data), 0.1)
    losses = []
    for x, y in data:
        losses.append(step(x, y))
        clip()
        opt.step()
        opt.zero_grad()
        schedule.step()
    return losses


def single(data=None, **overrides: Any) -> list[float]:
    m = model(**overrides)

    def step(x, y):
        loss = m.loss(lf.tensor(x), lf.tensor(y))
        loss.backward()
        return loss.item()

    return train(m.parameters(), step, lambda: optim.clip_grad_norm_(m.parameters(), 1.0), data or batches())


class GlobalView:
    """A stage's layout as distributed tensors on its dp ranks (the layout kind training plans with
    tp or ZeRO use): weights replicated, batch rows sharded, gradients resharded to replicated."""

    def __init__(self, layer, mesh: dist.ProcessMesh) -> None:
        self.layer, self.mesh = layer, mesh
        for p in layer.parameters():
            replace_payload(p, dist.shard_tensor(p, mesh, ["R"])._data)

    batch_placements = (dist.Shard(0),)

    def batch(self, read, batch_size):
        n = self.mesh.size()
        mine = {}
        for r in dist.get_backend().hosted(self.mesh.ranks):
            i = self.mesh.coord(r)[0]
            mine[r] = read(slice(i * batch_size // n, (i + 1) * batch_size // n))
        some = next(iter(mine.values()))
        return tuple(
            dist.from_local(
                {r: a[k] for r, a in mine.items()}, self.mesh, ["S(0)"], (batch_size, *some[k].shape[1:])
            )
            for k in range(len(some))
        )

    def loss(self, t) -> float:
        return float(mesh_value(t))  # over the stage's ranks: unshard would wait for every process

    def reduce_grads(self) -> None:
        for p in self.layer.parameters():
            p.grad = dist.reshard(p.grad, self.mesh, ["R"])

    def settle(self) -> None:
        pass


def pipelined(
    name: str,
    pp: int,
    dp: int = 1,
    data=None,
    rank: int | None = None,
    layout=None,
    mode: str = "eager",
    **overrides,
) -> dict:
    """The pipeline run's losses ``{rank: [...]}``: every rank under sim (threads), or ``rank``'s
    under MPI. ``mode="static"`` runs each stage's jobs as programs (uncompiled: the compiled ones
    are tested once, on their own)."""
    data = data or batches()
    m, v = SCHEDULES[name]
    mesh = dist.ProcessMesh((pp, dp), ["pp", "dp"])
    pipe = Pipeline.build(pipeline_parts(model(**overrides), S), mesh, name, m, v)

    def body(r: int) -> list[float]:
        rp = pipe.for_rank(r, layout, mode, compiler="none")
        return train(rp.parameters(), rp.step, lambda: (rp.reduce_grads(), rp.clip_grad_norm(1.0)), data)

    if rank is not None:
        return {rank: body(rank)}
    return dist.run_ranks(range(pp * dp), body)


def worst(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
