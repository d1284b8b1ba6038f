"""The OpenAI-compatible server, driven over HTTP with the official ``openai`` client (sync and async)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest

import llmkit.framework as lf
from llmkit.infer import ChatTemplate, Tokenizer

from .conftest import API_KEY


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = httpx.get(server.url + "/health", headers=server.headers()).json()
    assert h["status"] == "ok" and h["model"] == "tiny"
    assert h["model_code_imported"] is False  # the server runs the model file alone


def test_completion_text_and_token_prompts_with_exact_usage(client, tok):
    prompt = "The history of the"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0)
    ids = tok.encode(prompt, add_bos=True)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids),
        7,
        len(ids) + 7,
    )
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=7, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    many = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=4, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.usage.prompt_tokens == len(ids) + 3 and many.usage.completion_tokens == 8
    assert many.choices[0].text == tok.decode(tok.encode(r.choices[0].text, add_bos=False)[:4]) or r.choices[
        0
    ].text.startswith(many.choices[0].text)


def test_streamed_text_equals_non_streamed_at_temperature_zero(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_streaming_roles_finish_and_usage(client, tok):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant"
    prompt_ids = ChatTemplate().render(msgs, Tokenizer.of(tok))
    assert full.usage.prompt_tokens == len(prompt_ids) and full.usage.completion_tokens == 16
    stream = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == msg.content
    finals = [c for c in stream if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert stream[-1].usage.total_tokens == full.usage.total_tokens


def test_n_and_seed(client):
    kw = dict(model="tiny", prompt="A", max_tokens=10, temperature=1.0, n=3, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # choice j is seeded seed + j
    assert a.usage.completion_tokens == 30 and a.usage.prompt_tokens == 2
    c = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5, temperature=0
    )
    assert [x.index for x in c.choices] == [0, 1] and c.choices[0].message.content == c.choices[
        1
    ].message.content


def test_logprobs_equal_the_training_models(client, trained, tok):
    model, _ = trained
    prompt = "The meaning of"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    with lf.no_grad():
        logits = model(lf.tensor(np.array([tok.encode(prompt)]))).logits.numpy()[0, -1].astype(np.float64)
    ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    best = int(np.argmax(ref))
    assert lp.token_logprobs[0] == pytest.approx(ref[best], abs=1e-5)
    top3 = np.argsort(-ref)[:3]
    assert sorted(lp.top_logprobs[0].values(), reverse=True) == pytest.approx(
        sorted(ref[top3], reverse=True), abs=1e-5
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and len(content[0].top_logprobs) == 2
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)
    assert (
        bytes(b for c in content for b in c.bytes).decode(errors="replace") == chat.choices[0].message.content
    )


def test_async_client_concurrent_requests_match_sequential(aclient, client):
    prompts = [f"Number {i} is" for i in range(6)]
    seq = [
        client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in prompts
    ]

    async def go():
        rs = await asyncio.gather(
            *[
                aclient.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
                for p in prompts
            ]
        )
        stream = await aclient.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hey"}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return [r.choices[0].text for r in rs], "".join(parts)

    got, streamed = asyncio.run(go())
    assert got == seq  # batch invariance through the whole server
    assert (
        streamed
        == client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hey"}], max_tokens=4, temperature=0
        )
        .choices[0]
        .message.content
    )


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"model": "nope", "prompt": "x"}, "model", "does not exist"),
        ({"model": "tiny", "prompt": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
        ({"model": "tiny", "prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10_000}, "max_tokens", "at most"),
        ({"model": "tiny", "prompt": [5] * 600}, "prompt", "maximum context length is 512"),
        ({"model": "tiny", "prompt": [99999]}, "prompt", "out of range"),
        ({"model": "tiny", "prompt": "x", "best_of": 3}, None, "best_of"),
        ({"model": "tiny", "prompt": "x", "frobnicate": 1}, "frobnicate", "Extra inputs"),
        ({"model": "tiny"}, "prompt", "required"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ],
)
def test_bad_requests_are_400_and_the_next_succeeds(server, body, param, words):
    r = httpx.post(server.base_url + "/completions", json=body, headers=server.headers(), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(
        server.base_url + "/completions",
        json={"model": "tiny", "prompt": "ok", "max_tokens": 2},
        headers=server.headers(),
        timeout=30,
    )
    assert ok.status_code == 200


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.status_code == 400 and "does not exist" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=1.5)
    assert "top_p" in e.value.message
    assert client.completions.create(model="tiny", prompt="fine", max_tokens=1).choices[0].finish_reason


def test_malformed_json_and_bad_chat(server):
    r = httpx.post(
        server.base_url + "/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={**server.headers(), "content-type": "application/json"},
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(
        server.base_url + "/chat/completions",
        headers=server.headers(),
        json={"model": "tiny", "messages": [{"role": "assistant", "content": "hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(
        server.base_url + "/chat/completions",
        headers=server.headers(),
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 600},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.base_url + "/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # health stays open (status only)


def test_metrics_in_prometheus_text(client, server):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics", headers=server.headers()).text
    for name in (
        "llmkit_requests_total",
        "llmkit_requests_running",
        "llmkit_requests_waiting",
        "llmkit_time_to_first_token_seconds_bucket",
        "llmkit_inter_token_latency_seconds_count",
        "llmkit_generation_tokens_per_second",
        "llmkit_kv_blocks_used",
        "llmkit_prefix_cache_hits_total",
    ):
        assert name in text, name
    assert 'llmkit_requests_total{endpoint="completions",status="200"}' in text
