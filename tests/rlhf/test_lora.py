"""RLHF with adapters: the engine's programs run the low-rank update, the trainer's log-probs stay
bit-equal to the engine's, the reference is the base with the adapters off (no weights of its own)."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.framework import optim
from llmkit.models.llama.lora import LoraConfig, adapters_disabled, apply_lora, lora_layers
from llmkit.rlhf import policy
from llmkit.rlhf.data import TokenBatch

from .conftest import small_model
from .test_exact import PROMPTS, engine_arrays, loss_fn, rollouts, trainer_logp

LORA = LoraConfig(r=4, alpha=8.0, targets=("all-linear",))


def lora_model(seed: int = 0):
    """A small policy with adapters on every projection, B drawn (not zero) so the update counts."""
    model = small_model(seed)
    apply_lora(model, LORA, seed)
    rng = np.random.default_rng(seed)
    for m in lora_layers(model).values():
        m.lora_B.set_value((0.05 * rng.standard_normal(m.lora_B.shape)).astype(np.float32))
    return model


def lora_step(model, temperature, lr=1e-3):
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = optim.AdamW(trainable, lr=lr)
    return policy.train_step(model, opt, loss_fn, ("mask", "old_logp", "advantages"), True, temperature, 1.0)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_rollouts_run_the_adapters_and_the_logprobs_stay_exact(tok, temperature):
    """The engine's programs read lora_A and lora_B themselves (the update in the program, not
    merged into a copy), their log-probs equal the trainer's bit for bit before the update and, after
    an optimizer step on the adapters, the engine samples from the updated ones."""
    model = lora_model()
    t = temperature or 1.0
    step = lora_step(model, t, lr=3e-3)
    ro = rollouts(model, tok, temperature)
    given = engine_arrays(ro)
    for name, p in model.named_parameters():
        assert id(p) in given and given[id(p)] is p._data, f"{name} is not read by the engine's programs"
    batch = ro.generate(PROMPTS, 2, seed=0, step=0)
    logp, roll, on, out = trainer_logp(step, batch)
    assert on.sum() == batch.num_tokens > 0
    np.testing.assert_array_equal(logp[on], roll[on])
    assert out["ratio_mean"] == 1.0
    ro.sync()
    after = ro.generate(PROMPTS, 2, seed=0, step=0)
    logp2, roll2, on2, _ = trainer_logp(step, after)
    np.testing.assert_array_equal(logp2[on2], roll2[on2])  # the updated adapters, on both sides
    assert after.logprobs != batch.logprobs


def test_the_adapters_change_what_the_engine_samples(tok):
    """With the adapters off the engine's log-probs are the base model's (a model without adapters),
    with them on they differ: the update is in the programs."""
    base = small_model()
    with_lora = lora_model()
    a = rollouts(base, tok, 0.0).generate(PROMPTS[:2], 1, seed=0, step=0)
    b = rollouts(with_lora, tok, 0.0).generate(PROMPTS[:2], 1, seed=0, step=0)
    assert a.logprobs != b.logprobs
    scorer = policy.scorer(base, True, 1.0)
    tb = TokenBatch.of(b.prompt_ids, b.completion_ids)
    with adapters_disabled(with_lora):
        ref = policy.scorer(with_lora, True, 1.0)
    segs = policy.segment_arrays(*tb.ids.shape)
    np.testing.assert_array_equal(
        ref(tb.ids, tb.targets, *segs)["logp"], scorer(tb.ids, tb.targets, *segs)["logp"]
    )
