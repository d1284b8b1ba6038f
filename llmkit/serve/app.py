"""The HTTP routes: a thin Starlette app over :class:`Serving` (``POST /v1/completions`` is served
as plain ASGI by the gate below: scoring clients send it by the thousand). Starlette, not FastAPI:
importing FastAPI (its OpenAPI models) was a quarter of ``llmkit serve``'s start, for request
parsing that pydantic's JSON reader does in one call here.

=========================  ==========================================================
``GET  /v1/models``        the one model this server runs
``POST /v1/completions``   text or token-id prompts; ``stream: true`` for SSE
``POST /v1/chat/completions``  messages rendered with the model file's chat template
``GET  /health``           200 ``{"status": "ok"}`` while the engine runs, else 503; details
                           (model, queue sizes, ...) only for callers holding the API key, if set
``GET  /metrics``          Prometheus text format (needs the API key, if set)
=========================  ==========================================================

Every error is OpenAI's body ``{"error": {...}}``: 400 for bad input (malformed JSON, unknown
model, out-of-range parameters, prompts or max_tokens beyond the context), 401 for a missing or
wrong API key (when one is set), 413 for a body over ``max_request_bytes``, 429 when the queue is
full, 500 with a request id (the traceback goes to the server log under that id, never to the client).
"""

from __future__ import annotations

import hmac
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import MAX_REQUEST_BYTES
from .metrics import CONTENT_TYPE
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
)
from .serving import ClientGone, JSONText, Serving

log = logging.getLogger("llmkit.serve")
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/models": "models"}
_PROTECTED = ("/v1/", "/metrics")  # paths that need the API key, when one is set


def _has_key(headers: Headers, api_key: str) -> bool:
    given = headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    return hmac.compare_digest(token.encode(), api_key.encode())


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """The message and the field (``param``) of pydantic's first error."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    # drop pydantic's union-branch names ("str", "list[int]") from the field path
    field = ".".join(p for p in loc if not p.startswith(("list[", "str", "int", "function-")))
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if not field:
        return msg, None
    if e.get("type") == "missing":
        return f"{field}: a required field is missing", field
    return f"{field}: {msg}", field


class _Gate:
    """The API key check, the request body's size limit and the request counter, as plain ASGI:
    Starlette's ``BaseHTTPMiddleware`` would pass every streamed chunk through an extra task and
    memory stream (a sixth of the event loop's time per token at 32 streams)."""

    def __init__(
        self, app: Any, serving: Serving, api_key: str | None, max_request_bytes: int, posts: dict[str, Any]
    ) -> None:
        self.app, self.serving, self.api_key, self.limit = app, serving, api_key, max_request_bytes
        self.posts = posts  # path -> plain ASGI handler of its POSTs (past the checks above)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = _ENDPOINTS.get(path)
        status = [500]

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        async def refuse(http_status: int, msg: str, code: str) -> None:
            response = JSONResponse(error_body(msg, code=code), status_code=http_status)
            await response(scope, receive, counting_send)

        try:
            headers = Headers(scope=scope)
            if (
                self.api_key is not None
                and path.startswith(_PROTECTED)
                and not _has_key(headers, self.api_key)
            ):
                what = "Incorrect API key provided" if headers.get("authorization") else "Missing API key"
                await refuse(401, f"{what}: pass it as 'Authorization: Bearer <key>'", code="invalid_api_key")
                return
            size = headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > self.limit:
                await refuse(413, self._too_large(), code="request_too_large")
                return
            if size is None and headers.get("transfer-encoding", "").lower() == "chunked":
                body = await self._read(receive)
                if body is None:
                    await refuse(413, self._too_large(), code="request_too_large")
                    return
                receive = _replay(body, receive)
            handler = self.posts.get(path) if scope["method"] == "POST" else None
            await (handler or self.app)(scope, receive, counting_send)
        finally:
            if endpoint is not None:
                self.serving.metrics.requests.labels(endpoint, str(status[0])).inc()

    def _too_large(self) -> str:
        return (
            f"the request body is larger than this server's limit of {self.limit} bytes (--max-request-bytes)"
        )

    async def _read(self, receive: Any) -> bytes | None:
        """A chunked body, or None once it passes the limit."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)  # the client went away: the app sees an empty body
            size += len(message.get("body", b""))
            if size > self.limit:
                return None
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(parts)


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that gives the body already read, then whatever the client sends next."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def build_app(
    serving: Serving,
    api_key: str | None = None,
    drain_timeout: float = 30.0,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> Starlette:
    """The app; its lifespan stops the engine thread (in-flight requests get ``drain_timeout`` s)."""
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: pass None to serve without one")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        serving.closing = True
        serving.runner.stop(drain_timeout=drain_timeout)

    def error(status: int, body: dict[str, Any]) -> JSONResponse:
        return JSONResponse(body, status_code=status)

    async def _api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error(exc.status, exc.body())

    async def _http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        body = error_body(str(exc.detail), type="invalid_request_error")
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def _internal(request: Request, exc: Exception) -> Response:
        rid = new_id("req")
        log.error("request %s (%s %s) failed", rid, request.method, request.url.path, exc_info=exc)
        msg = f"internal server error; the server log has the details under request id {rid}"
        return JSONResponse(
            error_body(msg, type="server_error", code="internal_error"),
            status_code=500,
            headers={"x-request-id": rid},
        )

    async def parse(request: Request, schema: type[BaseModel]) -> Any:
        """The request body read and validated in one pass by pydantic's JSON reader (whatever its
        content type); a 400 naming the first bad field when it is not one."""
        try:
            return schema.model_validate_json(await request.body())
        except ValidationError as e:
            msg, param = _validation_message(e.errors(include_url=False))
            raise APIError(400, msg, param=param) from None

    async def completions(scope: dict, receive: Any, send: Any) -> None:
        """POST /v1/completions, as plain ASGI: the routing and middleware of a framework were two
        fifths of an echo request's event-loop time (64 of them at once: lm-eval's scoring).
        Errors are the handlers' bodies above (any other exception reaches the 500 handler)."""
        request = Request(scope, receive)
        try:
            body = await parse(request, CompletionRequest)
            response = await respond(await serving.completions(body, gone(request)))
        except ClientGone:
            response = Response(status_code=499)
        except APIError as exc:
            response = error(exc.status, exc.body())
        await response(scope, receive, send)

    async def health(request: Request) -> Response:
        status = "closing" if serving.closing else "ok" if serving.runner.alive else "engine stopped"
        body: dict[str, Any] = {"status": status}
        if api_key is None or _has_key(request.headers, api_key):
            stats = serving.engine.stats()
            body |= {
                "model": serving.model_name,
                "running": stats["running"],
                "waiting": stats["waiting"],
                "kv_blocks_used": stats["kv_blocks_used"],
                "model_code_imported": any(m.startswith("llmkit.models") for m in sys.modules),
                "last_engine_error": None if serving.runner.error is None else repr(serving.runner.error),
            }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    async def models(request: Request) -> Response:
        return JSONResponse(serving.models())

    async def respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        if isinstance(result, JSONText):
            return Response(result.encode(), media_type="application/json")
        return StreamingResponse(
            result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    def gone(request: Request) -> Any:
        async def wait() -> None:  # ASGI: receive() after the body returns http.disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass

        return wait

    async def chat(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)  # an APIError goes to its handler
        try:
            return await respond(await serving.chat(body, gone(request)))
        except ClientGone:
            return Response(status_code=499)

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ],
        middleware=[
            Middleware(
                _Gate,
                serving=serving,
                api_key=api_key,
                max_request_bytes=max_request_bytes,
                posts={"/v1/completions": completions},
            )
        ],
        exception_handlers={APIError: _api_error, HTTPException: _http, Exception: _internal},
        lifespan=lifespan,
    )
    app.state.serving = serving
    return app
