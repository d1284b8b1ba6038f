"""Rollouts on the engine bound to the live policy, and exact log-probs.

The engine's log-prob of each sampled token and the trainer's recomputation (its compiled train
step's forward, before the update) are compared bit for bit: greedy and sampled, batches of 1 and
8. After an optimizer step the engine must sample from the new weights (its log-probs equal the
trainer's forward on the updated model) without reusing a prefix computed with the old ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.framework import optim
from llmkit.rlhf import algorithms, policy
from llmkit.rlhf.data import TokenBatch
from llmkit.rlhf.rollout import Rollouts

from .conftest import small_model

PROMPTS = ["The value of", "Return the", "A list of the", "If the argument is"]
LONG = "The following methods can be defined to customize the meaning of attribute access for class instances"


def loss_fn(logp, logits, values, mask, old_logp, advantages):
    return algorithms.clipped_policy_loss(logp, old_logp, advantages, mask)


def setup(temperature, exact=True, seed=0, lr=1e-3):
    model = small_model(seed)
    opt = optim.AdamW(model.parameters(), lr=lr)
    t = temperature or 1.0  # greedy rollouts report log-probs at temperature 1
    step = policy.train_step(model, opt, loss_fn, ("mask", "old_logp", "advantages"), exact, t, 1.0)
    return model, step, t


def rollouts(model, tok, temperature, exact=True):
    return Rollouts(model, tok, max_tokens=12, temperature=temperature, max_batch=8, exact=exact)


def trainer_logp(step, batch, seed=0):
    """One train step on the batch: (its pre-update log-probs, the engine's, mask, outputs)."""
    tb = TokenBatch.of(batch.prompt_ids, batch.completion_ids)
    roll = batch.token_array(tb.ids.shape[1])
    mask = tb.mask.astype(np.float64)
    adv = np.random.default_rng(seed).standard_normal(tb.ids.shape) * mask
    out = step(tb.ids, tb.targets, *policy.segment_arrays(*tb.ids.shape), mask, roll, adv)
    return out["logp"], roll, mask > 0, out


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("prompts,n", [(PROMPTS[:1], 1), (PROMPTS, 2)], ids=["batch1", "batch8"])
def test_logprob_diff_is_zero(tok, temperature, prompts, n):
    model, step, _ = setup(temperature)
    ro = rollouts(model, tok, temperature)
    batch = ro.generate(prompts, n, seed=0, step=0)
    assert len(batch.completion_ids) == len(prompts) * n
    logp, roll, on, out = trainer_logp(step, batch)
    assert on.sum() == batch.num_tokens > 0
    np.testing.assert_array_equal(logp[on], roll[on])  # bit for bit
    assert out["ratio_mean"] == 1.0 and out["clip_frac"] == 0.0


def test_the_engine_samples_from_the_updated_weights_with_no_stale_prefix(tok):
    model, step, t = setup(0.8, lr=3e-3)
    ro = rollouts(model, tok, 0.8)
    before = ro.generate([LONG], 1, seed=0, step=0)  # a prompt of more than one 16-token block
    again = ro.generate([LONG], 1, seed=0, step=0)
    assert again.logprobs == before.logprobs and ro.engine.stats()["prefix_cache_hits"] == 1
    trainer_logp(step, before)  # one optimizer step
    ro.sync()
    after = ro.generate([LONG], 1, seed=0, step=0)
    assert ro.engine.stats()["prefix_cache_hits"] == 1  # nothing cached before the update is used
    assert after.logprobs != before.logprobs
    # the engine's log-probs are the updated model's, as the trainer's forward computes them
    scorer = policy.scorer(model, True, t)
    tb = TokenBatch.of(after.prompt_ids, after.completion_ids)
    fresh = scorer(tb.ids, tb.targets, *policy.segment_arrays(*tb.ids.shape))["logp"]
    on = tb.mask > 0
    np.testing.assert_array_equal(fresh[on], after.token_array(tb.ids.shape[1])[on])


def engine_arrays(ro):
    """What the engine's programs are given as weights at their next call: {id: array}."""
    runner = ro.engine.runner
    out = {}
    for p in runner._live:
        for t, a in zip(p.concrete.captures, p.capture_arrays(runner._weight_cache), strict=True):
            out[id(t)] = a
    return out


def test_the_engine_reads_the_policy_s_parameters_themselves(tok):
    """With exact log-probs, every weight the engine's programs read is a parameter's own array (no
    copy, nothing to sync); a parameter rebound as an optimizer step rebinds it is what the very
    next rollout samples from, with no call in between."""
    model = small_model()
    ro = rollouts(model, tok, 0.8)
    given = engine_arrays(ro)
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert id(p) in given, f"{name} is not read by the engine's programs"
        a = given[id(p)]
        assert a is p._data and np.shares_memory(a, p.numpy()), name
    before = ro.generate(PROMPTS[:1], 1, seed=0, step=0)
    norm = params["model.norm.weight"]
    norm.set_value(norm.numpy() * 3.0)  # a new array, as the optimizer's update binds one
    assert engine_arrays(ro)[id(norm)] is norm._data
    after = ro.generate(PROMPTS[:1], 1, seed=0, step=0)
    assert after.logprobs[0][0] != before.logprobs[0][0]  # the first token's: the new weights'


def test_without_exact_logprobs_the_difference_is_small_but_not_zero(tok):
    model, step, _ = setup(0.8, exact=False)
    ro = rollouts(model, tok, 0.8, exact=False)
    batch = ro.generate(PROMPTS, 2, seed=0, step=0)
    logp, roll, on, _ = trainer_logp(step, batch)
    diff = np.abs(logp[on] - roll[on]).max()
    assert 0 < diff < 1e-4
    assert ro.sync() > 0  # the engine's relaid weight copies are rebuilt


def test_rollouts_are_a_function_of_seed_and_step(tok):
    model = small_model()
    ro = rollouts(model, tok, 1.0)
    a = ro.generate(PROMPTS[:2], 2, seed=3, step=5)
    b = ro.generate(PROMPTS[:2], 2, seed=3, step=5)
    c = ro.generate(PROMPTS[:2], 2, seed=3, step=6)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert a.completion_ids != c.completion_ids
    assert a.completion_ids[0] != a.completion_ids[1]  # samples of one prompt differ


def test_the_exact_train_step_has_the_gradients_of_the_model_s_own_forward():
    """The compiled exact step (tiled linears, paged attention over a pool of the batch's own keys
    and values) against eager autograd of the model's own forward (linear, sdpa): an independent
    computation. Several rows of different lengths: with more than one row the keys' and values'
    gradients once went into a copy of the pool's gradient (paged_attention_grad) and were lost.
    SGD at lr 1 makes each weight's change its gradient (float32 weights of magnitude <= 1: 1e-6)."""
    import llmkit.framework as lf

    model, ref = small_model(0), small_model(0)
    opt = optim.SGD(model.parameters(), lr=1.0)

    def mean_logp(logp, logits, values, mask):
        return -(logp * mask).sum() / mask.sum(), {}

    step = policy.train_step(model, opt, mean_logp, ("mask",), True, 1.0, None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4000, n).tolist() for n in (2, 5, 3)]
    tb = TokenBatch.of(prompts, [rng.integers(3, 4000, n).tolist() for n in (6, 2, 4)])
    mask = tb.mask.astype(np.float64)
    before = [p.numpy().copy() for p in model.parameters()]
    out = step(tb.ids, tb.targets, *policy.segment_arrays(*tb.ids.shape), mask)

    fwd = policy.PolicyForward(ref, exact=False)
    logits = fwd.logits(fwd.hidden(lf.tensor(tb.ids), None, None, None, None))
    loss, _ = mean_logp(lf.ops.token_logprobs(logits, lf.tensor(tb.targets)), None, None, lf.tensor(mask))
    loss.backward()
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-6)
    for (name, p), b, r in zip(model.named_parameters(), before, ref.parameters(), strict=True):
        np.testing.assert_allclose(b - p.numpy(), r.grad.numpy(), atol=1e-6, err_msg=name)
