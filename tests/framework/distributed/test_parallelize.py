"""A ParallelPlan applied to a Llama on ``sim`` (float64): loss and gradients equal the plain model
for dp, tp, tp+sp and dp x tp; the collectives are Megatron's (one reduction per row-parallel
product, reduce-scatter/all-gather with sequence parallelism, never the full logits); the ZeRO
stages leave parameters, gradients and optimizer state where the plan says, with the bytes a
numpy count of the shards gives."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework import optim
from llmkit.framework.distributed.parallelize import Parallelized
from llmkit.framework.distributed.plan import ParallelPlan
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM

B, S, V, H = 4, 8, 96, 16
CFG = dict(
    vocab_size=V, hidden_size=H, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, max_position_embeddings=16,
)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def sim_float64():
    dist.init("sim")
    before = lf.get_default_dtype()
    lf.set_default_dtype("float64")
    yield
    lf.set_default_dtype(before)


def model():
    lf.seed(0)
    return LlamaForCausalLM(LlamaConfig.from_preset("tiny", **CFG))


def batch():
    rng = np.random.default_rng(1)
    return rng.integers(0, V, (B, S)), rng.integers(0, V, (B, S))


@pytest.fixture(scope="module")
def reference():
    m = model()
    x, y = batch()
    loss = m.loss(lf.tensor(x), lf.tensor(y))
    loss.backward()
    return loss.item(), {n: p.grad.numpy() for n, p in m.named_parameters()}


class Recorder:
    """The collectives the sim backend runs: (kind, shape of one member's input)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, tuple]] = []
        backend = dist.get_backend()
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            monkeypatch.setattr(backend, kind, self.wrap(kind, getattr(backend, kind)))

    def wrap(self, kind, fn):
        def run(group, xs, *args, **kw):
            if len(group) > 1:
                self.calls.append((kind, tuple(next(iter(xs.values())).shape)))
            return fn(group, xs, *args, **kw)

        return run


def run(plan, monkeypatch=None):
    m = model()
    par = Parallelized(m, plan)
    x, y = batch()
    rec = Recorder(monkeypatch) if monkeypatch is not None else None
    loss = m.loss(*par.batch(lambda rows: (x[rows], y[rows]), B))
    forward = list(rec.calls) if rec else None
    loss.backward()
    par.reduce_grads()
    grads = {n: dist.unshard(p.grad).numpy() for n, p in m.named_parameters()}
    return dist.unshard(loss).item(), grads, forward


@pytest.mark.parametrize(
    "kw", [{"dp": 2}, {"tp": 2}, {"tp": 2, "sp": True}, {"dp": 2, "tp": 2, "sp": True}, {"dp": 4}], ids=str
)
def test_loss_and_gradients_equal_the_plain_model(reference, kw):
    loss, grads, _ = run(ParallelPlan.make("llama", **kw))
    assert loss == pytest.approx(reference[0], rel=1e-12)
    for name, g in reference[1].items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("sp", [False, True])
def test_the_forward_communicates_as_megatron_does(monkeypatch, sp):
    _, _, calls = run(ParallelPlan.make("llama", tp=2, sp=sp), monkeypatch)
    stream = [c for c in calls if c[1] == (B, S, H) or c[1] == (B, S // 2, H)]
    layers = CFG["num_hidden_layers"]
    if sp:  # embedding + o + down reduce-scattered over the sequence; each norm's output gathered
        assert [k for k, _ in stream].count("reduce_scatter") == 1 + 2 * layers
        assert [k for k, _ in stream].count("all_gather") == 2 * layers + 1
        assert "all_reduce" not in [k for k, _ in stream]
    else:  # embedding + o + down all-reduced, nothing else of the stream moves
        assert [k for k, _ in stream] == ["all_reduce"] * (1 + 2 * layers)
    # vocab-parallel cross-entropy: per-row statistics move, never (a tp-th of) the logits
    assert max(np.prod(shape) for _, shape in calls) <= B * S * H


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_place_state_and_count_its_bytes(zero):
    plan = ParallelPlan.make("llama", dp=2, tp=2, zero=zero)
    m = model()
    par = Parallelized(m, plan)
    opt = optim.AdamW(m.parameters(), lr=1e-3)
    par.shard_optimizer(opt)
    x, y = batch()
    m.loss(*par.batch(lambda rows: (x[rows], y[rows]), B)).backward()
    par.reduce_grads()
    expect = 0
    mesh = par.mesh
    for name, p in m.named_parameters():
        pp, gp, sp = (plan.param_placements(name, p.shape), plan.grad_placements(name, p.shape),
                      plan.state_placements(name, p.shape))  # fmt: skip
        assert p._data.placements == pp and p.grad._data.placements == gp, name
        j = next(j for j, q in enumerate(opt.params) if q is p)
        for t in opt.states[j].values():
            assert t._data.placements == sp, name
        # rank 0 is the fullest (np.array_split makes the first chunks the longest): count its shards
        for placements, copies in ((pp, 1), (gp, 1), (sp, 2)):  # AdamW: two moments
            local = np.zeros(p.shape)
            for m_dim, pl in enumerate(placements):
                if pl.is_shard():
                    local = np.array_split(local, mesh.shape[m_dim], axis=pl.dim)[0]
            expect += copies * local.size * 8
    assert par.state_bytes() == expect
    assert plan.state_bytes({n: p.shape for n, p in m.named_parameters()}, 8, 2, 8) == expect
    opt.step()
    par.settle()
    for name, p in m.named_parameters():
        assert p._data.placements == plan.param_placements(name, p.shape)
