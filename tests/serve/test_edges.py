"""The server's edges: an empty API key, what /health tells a stranger, internal errors, request
body limits, and a huge prompt that must not hold up other clients."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest

from llmkit.cli import main as cli_main
from llmkit.serve import MAX_REQUEST_BYTES
from llmkit.serve.app import build_app
from llmkit.serve.serving import Serving

from .conftest import API_KEY
from .test_mailbox import _FakeRunner

KEY = {"Authorization": f"Bearer {API_KEY}"}


@pytest.mark.parametrize(
    "argv, env, source",
    [
        (["--api-key", ""], None, "--api-key"),
        (["--api-key", "  "], None, "--api-key"),
        ([], "", "LLMKIT_API_KEY"),
    ],
)
def test_an_empty_api_key_refuses_to_start(argv, env, source, tmp_path, monkeypatch, capsys):
    if env is not None:
        monkeypatch.setenv("LLMKIT_API_KEY", env)
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", str(tmp_path / "model.llmkit"), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{source} is empty" in err and "let anyone in" in err
    with pytest.raises(ValueError, match="api_key is empty"):
        build_app(Serving(_FakeRunner()), api_key="")  # type: ignore[arg-type]


def test_health_tells_a_stranger_only_whether_the_engine_is_up(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    full = httpx.get(server.url + "/health", headers=KEY).json()
    assert full["status"] == "ok" and full["model"] == "tiny" and full["model_code_imported"] is False
    assert httpx.get(server.url + "/health", headers={"Authorization": "Bearer wrong"}).json() == {
        "status": "ok"
    }
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert "llmkit_requests_total" in httpx.get(server.url + "/metrics", headers=KEY).text


def _app(**kw):
    serving = Serving(_FakeRunner())  # type: ignore[arg-type]
    return serving, build_app(serving, api_key=API_KEY, **kw)


def _call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_a_closing_server_is_503_to_monitors(caplog):
    serving, app = _app()
    serving.closing = True
    r = _call(app, "GET", "/health")
    assert r.status_code == 503 and r.json() == {"status": "closing"}


def test_an_internal_error_sends_a_request_id_and_logs_the_traceback(caplog):
    serving, app = _app()

    async def broken(*args):
        raise RuntimeError("secret: /srv/models/key.txt")

    serving.completions = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="llmkit.serve"):
        r = _call(app, "POST", "/v1/completions", json={"model": "m", "prompt": "x"}, headers=KEY)
    assert r.status_code == 500
    err = r.json()["error"]
    rid = r.headers["x-request-id"]
    assert rid.startswith("req-") and rid in err["message"] and err["type"] == "server_error"
    assert "secret" not in r.text and "RuntimeError" not in r.text
    (record,) = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert record.exc_info and "secret: /srv/models/key.txt" in str(record.exc_info[1])


async def _chunks(data: bytes, size: int = 1000):
    """The body without a content-length: chunked transfer encoding."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_a_body_over_the_limit_is_413_naming_the_limit():
    _, app = _app(max_request_bytes=2000)
    body = b'{"model": "m", "prompt": "' + b"x" * 3000 + b'"}'
    for content in (body, _chunks(body)):  # with a content-length, and chunked
        r = _call(
            app,
            "POST",
            "/v1/completions",
            content=content,
            headers={**KEY, "content-type": "application/json"},
        )
        assert r.status_code == 413, r.text
        assert "limit of 2000 bytes (--max-request-bytes)" in r.json()["error"]["message"]
    small = b'{"model": "nope", "prompt": "x"}'
    r = _call(
        app,
        "POST",
        "/v1/completions",
        content=_chunks(small, 7),
        headers={**KEY, "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"  # a chunked body under it


def test_the_server_refuses_a_body_over_its_default_limit(server):
    body = b'{"model": "tiny", "prompt": "' + b"x" * MAX_REQUEST_BYTES + b'"}'
    r = httpx.post(
        server.base_url + "/completions", content=body, headers={**KEY, "content-type": "application/json"}
    )
    assert r.status_code == 413 and str(MAX_REQUEST_BYTES) in r.json()["error"]["message"]
    ok = httpx.post(
        server.base_url + "/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 2}, headers=KEY
    )
    assert ok.status_code == 200


@pytest.mark.slow
def test_a_huge_prompt_does_not_hold_up_other_clients(server):
    """While a prompt of a few MB is being tokenized, /health still answers: the big request is
    still in flight when the small one comes back."""
    text = "The history of the world is long and full of words. " * (MAX_REQUEST_BYTES // 60)
    done: dict[str, float] = {}

    def big() -> None:
        r = httpx.post(
            server.base_url + "/completions", json={"model": "tiny", "prompt": text}, headers=KEY, timeout=120
        )
        done["big"] = time.monotonic()
        done["status"] = r.status_code
        done["code"] = r.json()["error"]["code"]

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.5)  # sent and being tokenized (that takes seconds)
    assert httpx.get(server.url + "/health", timeout=120).status_code == 200
    answered = time.monotonic()
    t.join(120)
    assert done["big"] > answered, "the health check waited for the huge prompt"
    assert (done["status"], done["code"]) == (400, "context_length_exceeded")
