"""The HTTP routes: a thin FastAPI app over :class:`Serving` (``POST /v1/completions`` is served
as plain ASGI by the gate below: scoring clients send it by the thousand).

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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import CONTENT_TYPE
from .protocol import (
    MAX_REQUEST_BYTES,
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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
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
) -> FastAPI:
    """The app; its lifespan stops the engine thread (in-flight requests get ``drain_timeout`` s)."""
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: pass None to serve without one")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        serving.closing = True
        serving.runner.stop(drain_timeout=drain_timeout)

    app = FastAPI(title="llmkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving

    def error(status: int, body: dict[str, Any]) -> JSONResponse:
        return JSONResponse(body, status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc.status, exc.body())

    def invalid(exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error(400, error_body(msg, param=param))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, error_body(str(exc.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        rid = new_id("req")
        log.error("request %s (%s %s) failed", rid, request.method, request.url.path, exc_info=exc)
        msg = f"internal server error; the server log has the details under request id {rid}"
        return JSONResponse(
            error_body(msg, type="server_error", code="internal_error"),
            status_code=500,
            headers={"x-request-id": rid},
        )

    async def completions(scope: dict, receive: Any, send: Any) -> None:
        """POST /v1/completions, as plain ASGI: FastAPI's routing, body parameter and middleware
        were two fifths of an echo request's event-loop time (64 of them at once: lm-eval's
        scoring). The body is read and validated in one pass by pydantic's JSON reader; errors
        are the handlers' bodies above (any other exception reaches the 500 handler)."""
        request = Request(scope, receive)
        try:
            try:
                body = CompletionRequest.model_validate_json(await request.body())
            except ValidationError as e:
                raise RequestValidationError(e.errors(include_url=False)) from None
            response = await respond(await serving.completions(body, gone(request)))
        except ClientGone:
            response = Response(status_code=499)
        except APIError as exc:
            response = error(exc.status, exc.body())
        except RequestValidationError as exc:
            response = invalid(exc)
        await response(scope, receive, send)

    app.add_middleware(
        _Gate,
        serving=serving,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        posts={"/v1/completions": completions},
    )

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
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

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.models()

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

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        try:
            return await respond(await serving.chat(body, gone(request)))
        except ClientGone:
            return Response(status_code=499)

    return app
