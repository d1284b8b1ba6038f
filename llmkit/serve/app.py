"""The HTTP routes: a thin FastAPI app over :class:`Serving`.

=========================  ==========================================================
``GET  /v1/models``        the one model this server runs
``POST /v1/completions``   text or token-id prompts; ``stream: true`` for SSE
``POST /v1/chat/completions``  messages rendered with the model file's chat template
``GET  /health``           liveness, queue sizes, and whether model code was imported
``GET  /metrics``          Prometheus text format
=========================  ==========================================================

Every error is OpenAI's body ``{"error": {...}}``: 400 for bad input (malformed JSON, unknown
model, out-of-range parameters, prompts or max_tokens beyond the context), 401 for a missing or
wrong API key (when one is set; /health and /metrics stay open), 429 when the queue is full.
"""

from __future__ import annotations

import hmac
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import CONTENT_TYPE
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from .serving import ClientGone, Serving

_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/models": "models"}


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


class _AuthAndCount:
    """The API key check on /v1/ routes and the request counter, as plain ASGI: Starlette's
    ``BaseHTTPMiddleware`` would pass every streamed chunk through an extra task and memory
    stream (a sixth of the event loop's time per token at 32 streams)."""

    def __init__(self, app: Any, serving: Serving, api_key: str | None) -> None:
        self.app, self.serving, self.api_key = app, serving, api_key

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

        try:
            if self.api_key is not None and path.startswith("/v1/"):
                given = Headers(scope=scope).get("authorization", "")
                token = given[7:] if given.lower().startswith("bearer ") else ""
                if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                    what = "Missing API key" if not given else "Incorrect API key provided"
                    msg = f"{what}: pass it as 'Authorization: Bearer <key>'"
                    body = error_body(msg, code="invalid_api_key")
                    await JSONResponse(body, status_code=401)(scope, receive, counting_send)
                    return
            await self.app(scope, receive, counting_send)
        finally:
            if endpoint is not None:
                self.serving.metrics.requests.labels(endpoint, str(status[0])).inc()


def build_app(serving: Serving, api_key: str | None = None, drain_timeout: float = 30.0) -> FastAPI:
    """The app; its lifespan stops the engine thread (in-flight requests get ``drain_timeout`` s)."""

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

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error(400, error_body(msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, error_body(str(exc.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return error(500, error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    app.add_middleware(_AuthAndCount, serving=serving, api_key=api_key)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        stats = serving.engine.stats()
        return {
            "status": "ok" if serving.runner.alive and not serving.closing else "closing",
            "model": serving.model_name,
            "running": stats["running"],
            "waiting": stats["waiting"],
            "kv_blocks_used": stats["kv_blocks_used"],
            "model_code_imported": any(m.startswith("llmkit.models") for m in sys.modules),
            "last_engine_error": None if serving.runner.error is None else repr(serving.runner.error),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.models()

    async def respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(
            result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        try:
            return await respond(await serving.completions(body, request.is_disconnected))
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        try:
            return await respond(await serving.chat(body, request.is_disconnected))
        except ClientGone:
            return Response(status_code=499)

    return app
