"""Scoring through the server: ``/v1/completions`` with ``echo`` (the prompt's tokens and their
log-probs), against transformers' log_softmax on the same weights (a model made with transformers,
exported by llmkit, served), driven with the official ``openai`` client."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest

from .conftest import start_server

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MODEL = "hf-tiny"


@pytest.fixture(scope="module")
def score_server(hf_model_file, tmp_path_factory):
    s = start_server(hf_model_file, tmp_path_factory.mktemp("srv") / "server.log", "--max-batch", "4")
    yield s
    assert s.stop() == 0, s.log.read_text()


@pytest.fixture(scope="module")
def client(score_server):
    return openai.OpenAI(base_url=score_server.base_url, api_key="none", max_retries=0, timeout=60)


def hf_logprobs(hf, ids: list[int]) -> np.ndarray:
    """transformers' log_softmax of its logits over ``ids`` [S, V] (float64)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def check_echo(lp, ids: list[int], ref: np.ndarray, text_of) -> None:
    """Echoed logprobs of a prompt ``ids``: tokens, the first token's nulls, values, offsets."""
    n = len(ids)
    assert lp.tokens[:n] == [text_of(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref[i, ids[i + 1]] for i in range(n - 1)]
    np.testing.assert_allclose(lp.token_logprobs[1:n], want, rtol=1e-4, atol=1e-4)
    for i in range(1, n):
        top = lp.top_logprobs[i]
        best = int(np.argmax(ref[i - 1]))
        assert top[text_of(best)] == pytest.approx(ref[i - 1, best], abs=1e-4)
        assert top[text_of(ids[i])] == lp.token_logprobs[i]  # the scored token is always listed
    offsets = np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]).tolist()
    assert lp.text_offset == offsets


def test_echo_string_prompt_scores_every_token_like_transformers(client, hf_model, tok):
    hf, _ = hf_model
    prompt = "Once upon a time, a little fox found a shiny stone."
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    (c,) = r.choices
    ids = tok.encode(prompt, add_bos=True)  # the BOS rule: a text prompt gets the BOS
    assert c.text == prompt and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids) and ids[0] == tok.bos_id
    check_echo(c.logprobs, ids, hf_logprobs(hf, ids), tok.token_text)
    assert all(len(t) <= 3 for t in c.logprobs.top_logprobs[1:])  # top-2 (+ the scored token)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    # a list of strings: one choice each, in order
    texts = ["The river runs", prompt, "A"]
    r = client.completions.create(model=MODEL, prompt=texts, max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in r.choices] == texts
    for text, c in zip(texts, r.choices):
        ids = tok.encode(text, add_bos=True)
        check_echo(c.logprobs, ids, hf_logprobs(hf, ids), tok.token_text)


def test_batched_id_prompts_with_one_generated_token_as_lm_eval_sends(client, hf_model, tok):
    """lm-eval's ``local-completions`` request: several id lists, max_tokens 1, logprobs 1, echo."""
    hf, _ = hf_model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tok.vocab_size, n).tolist() for n in (5, 17, 33, 2)]
    r = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for ids, c in zip(prompts, r.choices):
        ref = hf_logprobs(hf, ids)
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + 1  # id prompts are taken as given: no BOS added
        check_echo(lp, ids, ref, tok.token_text)
        nxt = int(np.argmax(ref[-1]))  # the generated token: greedy from the last position
        assert lp.tokens[-1] == tok.token_text(nxt)
        assert lp.token_logprobs[-1] == pytest.approx(ref[-1, nxt], abs=1e-4)
        assert c.text == tok.decode(ids) + tok.decode([nxt])


def test_a_prompt_scores_the_same_bits_alone_and_in_a_concurrent_batch(score_server, client, tok):
    rng = np.random.default_rng(1)
    target = rng.integers(3, tok.vocab_size, 40).tolist()
    body = {"model": MODEL, "max_tokens": 0, "echo": True, "logprobs": 1}
    alone = client.completions.create(prompt=[target], **body).choices[0].logprobs

    async def many() -> list:
        aclient = openai.AsyncOpenAI(base_url=score_server.base_url, api_key="none", max_retries=0)
        others = [rng.integers(3, tok.vocab_size, n).tolist() for n in (7, 21, 50, 12, 33, 3, 28)]
        jobs = [aclient.completions.create(prompt=[p], **body) for p in others[:4]]
        jobs.append(aclient.completions.create(prompt=[*others[4:], target], **body))
        return await asyncio.gather(*jobs)

    batched = asyncio.run(many())[-1].choices[-1].logprobs
    assert batched.token_logprobs == alone.token_logprobs  # exactly: JSON floats round-trip
    assert batched.top_logprobs == alone.top_logprobs


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"echo": True, "n": 2}, "n", "n: 2 choices with echo: true are not supported"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens: 0 scores the prompt without generating"),
        ({"echo": True, "stream": True}, "stream", "stream: echo: true is not supported"),
        ({"echo": True, "logprobs": 6}, "logprobs", "logprobs: Input should be less than or equal to 5"),
    ],
)
def test_bad_echo_requests_are_one_clear_400_and_the_server_stays_healthy(
    score_server, extra, param, message
):
    good = {"model": MODEL, "prompt": "Hello there", "max_tokens": 1}
    r = httpx.post(score_server.base_url + "/completions", json={**good, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(message), err
    assert httpx.get(score_server.url + "/health", timeout=5).status_code == 200
    ok = httpx.post(score_server.base_url + "/completions", json=good, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
