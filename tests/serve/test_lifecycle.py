"""Load, cancellation, a full queue and shutdown, against real server processes."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from .conftest import start_server


def wait_idle(server, timeout: float = 20.0) -> dict:
    """/health once no request runs or waits any more."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(server.url + "/health").json()
        if (h["running"], h["waiting"]) == (0, 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


@pytest.fixture(scope="module")
def busy_server(model_file, tmp_path_factory):
    s = start_server(model_file, tmp_path_factory.mktemp("busy") / "server.log", "--max-batch", "16")
    yield s
    assert s.stop() == 0, s.log.read_text()


@pytest.mark.slow
def test_64_concurrent_streams_some_cancelled_no_errors_no_leaked_blocks(busy_server):
    client = openai.AsyncOpenAI(base_url=busy_server.base_url, api_key="none", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[str, int]:
        kw = dict(model="tiny", max_tokens=24, temperature=0.8, seed=i, stream=True)
        if i % 2:
            stream = await client.completions.create(prompt=f"Request {i} says", **kw)
        else:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": f"Hi {i}"}], **kw
            )
        chunks, finish = 0, None
        async for c in stream:
            chunks += 1
            if c.choices and c.choices[0].finish_reason:
                finish = c.choices[0].finish_reason
            if i % 4 == 3 and chunks == 3:  # a quarter of the clients walk away mid-stream
                await stream.close()
                return "cancelled", chunks
        return finish or "missing", chunks

    async def go():
        return await asyncio.gather(*[one(i) for i in range(64)])

    results = asyncio.run(go())
    assert [r for r, _ in results].count("cancelled") == 16
    assert all(r in ("length", "cancelled") for r, _ in results), results
    h = wait_idle(busy_server)
    assert (h["running"], h["waiting"], h["kv_blocks_used"]) == (0, 0, 0), h
    assert h["last_engine_error"] is None
    text = httpx.get(busy_server.url + "/metrics").text
    served = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmkit_requests_total{") and 'status="200"' in line
    )
    assert served == 64


def test_client_disconnect_cancels_and_frees_blocks(busy_server):
    with httpx.stream(
        "POST",
        busy_server.base_url + "/completions",
        timeout=30,
        json={"model": "tiny", "prompt": "Long story", "max_tokens": 480, "ignore_eos": True, "stream": True},
    ) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(3)]
        assert first[0].startswith("data: ")
        assert httpx.get(busy_server.url + "/health").json()["kv_blocks_used"] > 0
    h = wait_idle(busy_server)
    assert (h["running"], h["kv_blocks_used"]) == (0, 0)
    # a plain (non-streaming) request whose client gives up is cancelled too (16 x 480 tokens: far
    # more than the compiled engine makes in the client's 0.3 s)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            busy_server.base_url + "/completions",
            timeout=0.3,
            json={"model": "tiny", "prompt": "x", "max_tokens": 480, "n": 16, "ignore_eos": True},
        )
    assert wait_idle(busy_server)["kv_blocks_used"] == 0


def test_full_queue_is_429(model_file, tmp_path):
    s = start_server(model_file, tmp_path / "server.log", "--max-batch", "1", "--max-queue", "1")
    try:

        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"model": "tiny", "prompt": "wait", "max_tokens": 100, "ignore_eos": True}
                return await asyncio.gather(
                    *[c.post(s.base_url + "/completions", json=body) for _ in range(8)]
                )

        rs = asyncio.run(go())
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
        err = next(r for r in rs if r.status_code == 429).json()["error"]
        assert err["type"] == "rate_limit_error" and "max_queue 1" in err["message"]
        ok = httpx.post(s.base_url + "/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("drain, finish", [(30.0, "length"), (0.0, "abort")])
def test_sigterm_finishes_or_cancels_in_flight_requests(model_file, tmp_path, drain, finish):
    s = start_server(model_file, tmp_path / "server.log", "--drain-timeout", str(drain))
    events: list = []

    def stream() -> None:
        body = {"model": "tiny", "prompt": "Tell me", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)

    t = threading.Thread(target=stream)
    t.start()
    while len(events) < 3:
        time.sleep(0.01)
    s.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert s.proc.wait(60) == 0, s.log.read_text()
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == finish
