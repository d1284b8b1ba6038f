"""Scoring prompts (``prompt_logprobs``): the score program against a float64 log-softmax of the
eager logits, bit-for-bit batch invariance, prefill only (no decode step, blocks freed)."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.infer import Engine, EngineConfig, FinishReason, SamplingParams

from .test_engine import GREEDY, prompts_of, signature

SCORE = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=5)


def reference_logprobs(model, prompt: list[int]) -> np.ndarray:
    """log_softmax of the eager forward's logits, in float64 (the formula written out) [S, V]."""
    with lf.no_grad():
        z = model(lf.tensor(np.array([prompt]))).logits.numpy()[0].astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def scores(c) -> list:
    """A completion's prompt logprobs, exactly: (token, logprob, top) per position."""
    return [None if x is None else (x.token_id, x.logprob, tuple(x.top)) for x in c.prompt_logprobs]


@pytest.fixture(scope="module")
def engine(model):
    return Engine.from_model(model, config=EngineConfig(max_batch=4))


def test_prompt_logprobs_equal_the_log_softmax_of_the_eager_logits(model, engine):
    # one chunk, several chunks (block size 16), a partial last one
    prompts = prompts_of([2, 16, 17, 40], seed=5)
    outs = engine.generate(prompts, SCORE)
    for p, o in zip(prompts, outs):
        ref = reference_logprobs(model, p)
        assert o.token_ids == [] and o.finish_reason == FinishReason.LENGTH
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        for i, c in enumerate(o.prompt_logprobs[1:]):  # position i predicts token i + 1
            assert c.token_id == p[i + 1]
            np.testing.assert_allclose(c.logprob, ref[i, p[i + 1]], rtol=1e-6, atol=1e-6)
            top = [t for t, _ in c.top]
            assert top == list(np.argsort(-ref[i], kind="stable")[:5])
            np.testing.assert_allclose([lp for _, lp in c.top], ref[i, top], rtol=1e-6, atol=1e-6)
            if top[0] == c.token_id:  # read from the same row: the greedy check is exact
                assert c.top[0][1] == c.logprob
    assert engine.blocks.num_used == 0


@pytest.mark.parametrize("compiler", ["none", "cinn"])
def test_scores_are_bitwise_the_same_alone_in_a_batch_and_beside_generation(model, compiler):
    eng = Engine.from_model(model, config=EngineConfig(max_batch=8, compiler=compiler))
    target = prompts_of([41], seed=7)[0]
    alone = scores(eng.generate([target], SCORE)[0])
    gen = prompts_of([23], seed=9)[0]
    gen_alone = signature(eng.generate([gen], GREEDY)[0])
    # a batch of scoring requests of other lengths, and a generating request in the same steps
    others = prompts_of([3, 18, 29, 50, 9], seed=8)
    mixed = eng.generate([gen, *others, target], [GREEDY, *[SCORE] * 6])
    assert scores(mixed[-1]) == alone
    assert signature(mixed[0]) == gen_alone  # the score program's logits are prefill's
    # a cached prefix is not used: a scored prompt is computed whole, so it scores the same
    eng.generate([target[:32] + [5, 6, 7]], GREEDY)
    again = eng.generate([target], SCORE)[0]
    assert again.num_cached_tokens == 0 and scores(again) == alone
    assert eng.blocks.num_used == 0


def test_scoring_is_prefill_only_and_batches_across_requests(model):
    """24 prompts of 10 tokens with max_batch 2: scoring requests take no decode slot, so the
    token budget (256 a step) runs all of them in one prefill step; nothing is decoded."""
    eng = Engine.from_model(model, config=EngineConfig(max_batch=2, max_tokens_per_step=256))
    prompts = prompts_of([10] * 24, seed=3)
    for p in prompts:
        eng.add_request(p, SCORE)
    outs = []
    while eng.has_work():
        outs += eng.step()
    stats = eng.stats()
    assert stats["steps"] == 1 and stats["generated_tokens"] == 0 and stats["prompt_tokens"] == 240
    assert len(outs) == 24 and all(o.finished and len(o.prompt_logprobs) == 10 for o in outs)
    assert eng.blocks.num_used == 0
    # lm-eval's form (max_tokens 1): one token each, from prefill's logits, still no decode step
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    assert eng.stats()["steps"] == 2 and eng.stats()["generated_tokens"] == 24


def test_bad_scoring_parameters_name_the_field(engine):
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 1 \(0 only with prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match=r"^prompt_logprobs: at most 5"):
        engine.add_request([1, 2, 3], SCORE.replace(prompt_logprobs=6))
    # a prompt filling the whole context can be scored (nothing to generate), not generated from
    full = [7] * engine.max_model_len
    with pytest.raises(ValueError, match="^prompt: 512 tokens do not fit .*at least one new token"):
        engine.add_request(full, GREEDY)
    assert len(engine.generate([full], SCORE)[0].prompt_logprobs) == 512
