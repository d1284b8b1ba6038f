"""The trainer's execution modes, each run through ``Trainer`` and checked against a run that
computes the same thing another way:

- static (the step as one traced program) against eager: bit-identical with the reference kernels
  (the same kernels on the same numbers in the same order), within 1e-6 relative with the CINN
  compiler's fused C kernels (float32 roundings in another order; 8e-8 measured over 6 steps);
- grad_accum=2 over micro-batches of 2 against grad_accum=1 over the same 4 sequences stacked:
  the same mean loss and gradient, summed in another order (1e-6 relative; 8e-8 measured);
- bfloat16 against float32: within one bfloat16 ulp of the loss (2^-5 for losses in [4, 8));
- each recompute policy (attention block, full layer, every k-th layer) against none:
  bit-identical losses (the backward recomputes the same forward ops), the recomputed parts
  really run twice, and less activation memory: the eager tape's bytes when the forward ends, or
  the static program's peak of live intermediates under the executor's liveness.
"""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.train.config import parse_config
from llmkit.train.data import BatchSampler
from llmkit.train.metrics import read_metrics
from llmkit.train.trainer import Trainer

from .runs import config, losses, raw_config

MODES = {"eager": {}, "static": {"mode": "static", "compiler": "none"}}

STEPS = 6


def train(out, **train):
    trainer = Trainer(config(out, steps=STEPS, save_every=0, eval_every=0, **train), quiet=True)
    trainer.fit()
    return trainer, losses(out)


def as_array(run_losses):
    assert sorted(run_losses) == list(range(1, STEPS + 1))
    return np.array([run_losses[s] for s in range(1, STEPS + 1)])


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return train(tmp_path_factory.mktemp("eager"))[1]


def test_static_equals_eager_bit_for_bit_with_reference_kernels(eager, tmp_path):
    trainer, static = train(tmp_path, mode="static", compiler="none")
    assert trainer.static_step.trace_count == 1  # traced once, then the program ran every step
    assert static == eager


@pytest.mark.slow
def test_static_with_the_compiler_matches_eager(eager, tmp_path):
    _, static = train(tmp_path, mode="static", compiler="cinn")
    np.testing.assert_allclose(as_array(static), as_array(eager), rtol=1e-6, atol=0)


class Stacked:
    """Batch i = micro-batches 2i and 2i + 1 of ``sampler``, stacked: a grad_accum=1 step over
    the tokens of a grad_accum=2 step."""

    def __init__(self, sampler: BatchSampler) -> None:
        self.inner, self.seed, self.step = sampler, sampler.seed, 0

    def batch(self, i, rows=slice(None)):
        (x0, y0), (x1, y1) = self.inner.batch(2 * i), self.inner.batch(2 * i + 1)
        return np.concatenate([x0, x1])[rows], np.concatenate([y0, y1])[rows]

    def state_dict(self):
        return {"seed": self.seed, "step": self.step}


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_grad_accum_equals_one_big_batch_of_the_same_tokens(tmp_path, mode):
    static = {"mode": "static", "compiler": "none"} if mode == "static" else {}
    trainer, accumulated = train(tmp_path / "accum", batch_size=2, grad_accum=2, **static)
    assert trainer.sampler.step == 2 * STEPS
    big = Trainer(config(tmp_path / "big", steps=STEPS, save_every=0, eval_every=0, batch_size=4), quiet=True)
    big.sampler = Stacked(BatchSampler(big.data.train, 2, big.cfg.train.seq_len, seed=0))
    big.fit()
    one_batch = losses(tmp_path / "big")
    np.testing.assert_allclose(as_array(accumulated), as_array(one_batch), rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_bfloat16_follows_float32(eager, tmp_path, mode):
    static = {"mode": "static", "compiler": "none"} if mode == "static" else {}
    trainer, half = train(tmp_path, dtype="bfloat16", **static)
    assert {p.dtype for p in trainer.model.parameters()} == {lf.bfloat16}
    moments = {v.dtype for s in trainer.optimizer.states for v in s.values()}
    assert moments == {np.dtype(np.float32)}  # bfloat16 cannot hold beta2 = 0.95 steps apart
    np.testing.assert_allclose(as_array(half), as_array(eager), rtol=0, atol=2.0**-5)


RECOMPUTE = [("attention", 1), ("full", 1), ("full", 2)]  # tiny has 2 layers: every 2 = layer 0


def recompute_run(out, mode, policy="none", every=1):
    raw = raw_config(out, steps=STEPS, save_every=0, eval_every=0, **MODES[mode])
    raw["parallel"] = {"recompute": policy, "recompute_every": every}
    trainer = Trainer(parse_config(raw), quiet=True)
    return trainer


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """Per mode: the losses and activation bytes of a run that recomputes nothing."""
    runs = {}
    for mode in MODES:
        out = tmp_path_factory.mktemp(f"stored-{mode}")
        trainer = recompute_run(out, mode)
        trainer.fit()
        runs[mode] = losses(out), trainer.activation_bytes
    return runs


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("policy", "every"), RECOMPUTE)
def test_recompute_changes_memory_not_losses(stored, tmp_path, mode, policy, every):
    trainer = recompute_run(tmp_path, mode, policy, every)
    layer, calls = trainer.model.model.layers[0], []
    part = layer if policy == "full" else layer.self_attn
    forward = part.forward

    def counted(*args, **kwargs):
        calls.append(trainer.step)
        return forward(*args, **kwargs)

    object.__setattr__(part, "forward", counted)
    trainer.fit()
    base_losses, base_bytes = stored[mode]
    assert losses(tmp_path) == base_losses  # bit-identical
    assert 0 < trainer.activation_bytes < base_bytes
    logged = read_metrics(tmp_path / "metrics.jsonl")[0]["activation_bytes_per_rank"]
    assert logged == trainer.activation_bytes
    if mode == "eager":  # the forward, and again in the backward
        assert [calls.count(s) for s in range(STEPS)] == [2] * STEPS
    else:  # traced once, the backward's recomputed forward included
        assert [s for s in calls if s < STEPS] == [0, 0]  # (later calls: the final text sample)


def test_recompute_saves_more_the_more_it_recomputes(stored, tmp_path):
    """Eager tape bytes: none > attention > full every 2 layers > full."""
    got = []
    for i, (policy, every) in enumerate([("attention", 1), ("full", 2), ("full", 1)]):
        trainer = recompute_run(tmp_path / str(i), "eager", policy, every)
        trainer.train_step()
        got.append(trainer.activation_bytes)
    assert stored["eager"][1] > got[0] > got[2] and stored["eager"][1] > got[1] > got[2], got
