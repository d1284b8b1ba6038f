"""The sampler against formulas written here, seeds, and parameter errors."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.infer.sampling import Sampler, SamplingParams, log_softmax, probabilities, sample, top_logprobs


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = np.array([0.5, 2.0, 2.0, -1.0], np.float32)
    assert sample(logits, SamplingParams(temperature=0.0), np.random.default_rng(0)) == 1
    assert Sampler(SamplingParams(temperature=0.0))(logits).token_id == 1


def test_filters_match_their_definitions():
    z = np.array([3.0, 1.0, 0.5, 0.0, -2.0, 2.5])
    # top-k keeps the k largest
    p = probabilities(z, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, softmax(np.where(np.isin(np.arange(6), [0, 5]), z, -np.inf)), rtol=1e-12)
    # temperature scales logits
    np.testing.assert_allclose(
        probabilities(z, SamplingParams(temperature=0.5)), softmax(z / 0.5), rtol=1e-12
    )
    # min-p drops tokens below min_p * p_max
    full = softmax(z)
    keep = full >= 0.2 * full.max()
    np.testing.assert_allclose(
        probabilities(z, SamplingParams(min_p=0.2)), np.where(keep, full, 0) / full[keep].sum(), rtol=1e-12
    )
    # top-p keeps the smallest prefix (by probability) reaching p
    order = np.argsort(-full)
    cum = np.cumsum(full[order])
    n = int(np.argmax(cum >= 0.8)) + 1
    keep = np.zeros(6, bool)
    keep[order[:n]] = True
    np.testing.assert_allclose(
        probabilities(z, SamplingParams(top_p=0.8)), np.where(keep, full, 0) / full[keep].sum(), rtol=1e-12
    )


def test_penalties():
    z = np.array([2.0, -1.0, 0.5, 1.0, 0.0])
    s = Sampler(
        SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        prompt_ids=[1],
    )
    for t in (0, 0, 3):
        s.accept(t)
    got = s.penalize(z)
    want = z.copy()
    want[0] = 2.0 / 2.0 - 0.5 - 0.25 * 2  # seen, generated twice
    want[1] = -1.0 * 2.0  # in the prompt only: repetition penalty, no presence/frequency
    want[3] = 1.0 / 2.0 - 0.5 - 0.25 * 1
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert s(z).token_id == int(np.argmax(want))


def test_seeded_draws_repeat_and_follow_the_distribution():
    z = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
    params = SamplingParams(temperature=1.0, seed=42)
    a = [Sampler(params)(z).token_id for _ in range(1)]
    s1, s2, s3 = Sampler(params), Sampler(params), Sampler(params, seed=43)
    seq1 = [s1(z).token_id for _ in range(200)]
    assert seq1 == [s2(z).token_id for _ in range(200)]
    assert seq1 != [s3(z).token_id for _ in range(200)]
    assert a[0] == seq1[0]
    counts = (
        np.bincount([Sampler(SamplingParams(seed=k))(z).token_id for k in range(4000)], minlength=4) / 4000
    )
    np.testing.assert_allclose(counts, [0.1, 0.2, 0.3, 0.4], atol=0.03)


def test_logprobs_are_the_raw_distribution():
    z = np.array([1.0, 3.0, 3.0, 0.0, -1.0], np.float32)
    params = SamplingParams(temperature=0.7, repetition_penalty=1.5, logprobs=3)
    c = Sampler(params, prompt_ids=[1], seed=0)(z)
    ref = np.log(softmax(z.astype(np.float64)))
    assert c.logprob == pytest.approx(ref[c.token_id], rel=1e-12)
    assert [t for t, _ in c.top] == [1, 2, 0]  # ties: lower id first
    np.testing.assert_allclose([lp for _, lp in c.top], ref[[1, 2, 0]], rtol=1e-12)
    np.testing.assert_allclose(log_softmax(z), ref, rtol=1e-12)
    assert top_logprobs(ref, 0) == []


def test_processed_logprobs_are_of_the_distribution_before_truncation():
    """logprobs_mode="processed": log-softmax of the penalized logits / temperature over the full
    vocabulary, as RLHF's trainer recomputes them (top-k does not renormalize them)."""
    z = np.array([1.0, 3.0, 2.5, 0.0, -1.0], np.float32)
    params = SamplingParams(
        temperature=0.7, top_k=2, repetition_penalty=1.5, logprobs=1, logprobs_mode="processed"
    )
    c = Sampler(params, prompt_ids=[1], seed=0)(z)
    penalized = z.astype(np.float64)
    penalized[1] /= 1.5  # token 1 was seen in the prompt, its logit positive
    ref = np.log(softmax(penalized / 0.7))
    assert c.token_id in (1, 2)
    assert c.logprob == pytest.approx(ref[c.token_id], rel=1e-12)
    greedy = Sampler(SamplingParams(temperature=0, logprobs=0, logprobs_mode="processed"))(z)
    assert greedy.logprob == pytest.approx(np.log(softmax(z.astype(np.float64)))[1], rel=1e-12)  # T=0 as 1
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        SamplingParams(logprobs_mode="truncated")


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_invalid_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**kw)


def test_stop_normalized():
    assert SamplingParams(stop="x").stop == ("x",)
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=("",))


def test_a_greedy_sampler_makes_no_generator_and_a_seeded_one_draws_as_an_eager_one():
    """The generator is made at the first draw: greedy requests never pay for one, and a seeded
    request's draws are those of numpy's generator seeded the same, made up front."""
    import numpy as np

    from llmkit.infer import Sampler, SamplingParams

    logits = np.linspace(-1.0, 1.0, 50, dtype=np.float32)
    greedy = Sampler(SamplingParams(temperature=0.0))
    assert greedy(logits).token_id == 49 and greedy._rng is None
    p = SamplingParams(temperature=1.0, seed=11)
    s = Sampler(p)
    got = [s(logits).token_id for _ in range(20)]
    z = logits.astype(np.float64)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    rng = np.random.default_rng(11)
    assert got == [int(rng.choice(50, p=probs)) for _ in range(20)]
