"""Serving: OpenAI requests -> engine requests -> responses or SSE streams.

One HTTP request becomes ``len(prompts) * n`` engine requests (choice ``j`` of a seeded request is
seeded ``seed + j``). Engine callbacks arrive on the engine thread and are handed to the request's
asyncio queue; the handler turns them into one JSON response, or into SSE chunks as they come::

    data: {"object": "chat.completion.chunk", "choices": [{"delta": {"role": "assistant", ...}}]}
    data: {... "delta": {"content": "Once"} ...}
    data: {... "delta": {}, "finish_reason": "length"}
    data: {... "choices": [], "usage": {...}}        (with stream_options.include_usage)
    data: [DONE]

A client that goes away (a closed stream, or a disconnect while waiting for a plain response)
cancels its engine requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmkit.infer import ChatTemplateError, EngineThread, FinishReason, RequestOutput, SamplingParams
from llmkit.infer.sampling import PromptLogprobs

from .metrics import Metrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenJSON,
    chat_logprobs,
    completion_logprobs,
    completion_logprobs_json,
    error_body,
    models_list,
    new_id,
    now,
    usage,
)

Disconnected = Callable[[], Awaitable[None]]  # returns when the client has gone away
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class ClientGone(Exception):
    """The client disconnected before its response was ready (its requests were cancelled)."""


@dataclass
class _Choice:
    index: int
    prompt_len: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    cached: int = 0
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[Any] | None = None  # echo: the prompt's token choices (None first)
    first: float | None = None
    last: float | None = None
    offset: int = 0  # characters of text streamed so far (completions logprobs text_offset)


class _Mailbox:
    """Outputs from the engine thread to one event loop, one loop wake-up per batch: a decode step
    at batch 32 hands over 32 outputs with one ``call_soon_threadsafe`` (one self-pipe write), not 32."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[tuple[asyncio.Queue, Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """From any thread: ``queue.put_nowait(item)`` on the loop, soon."""
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)


class _Submission:
    """The engine requests behind one HTTP request, and their outputs on an asyncio queue."""

    def __init__(self, serving: Serving, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        self.serving = serving
        self.arrival = time.monotonic()
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        mailbox = serving.mailbox()
        self.choices: list[_Choice] = []
        self.ids: list[str] = []
        self.prompt_tokens = sum(len(p) for p in prompts)
        try:
            for p in prompts:
                for j in range(n):
                    i = len(self.choices)
                    self.choices.append(_Choice(i, len(p)))
                    seed = None if params.seed is None else params.seed + j
                    cb = lambda out, i=i: mailbox.post(self.queue, (i, out))
                    self.ids.append(serving.runner.submit(p, params, callback=cb, seed=seed))
        except BaseException as e:
            self.abort()
            if isinstance(e, ValueError):  # the engine's own checks, naming the parameter
                raise APIError(400, str(e), param=str(e).split(":", 1)[0]) from None
            raise
        self.pending = len(self.choices)

    @property
    def done(self) -> bool:
        return self.pending == 0

    def abort(self) -> None:
        """Cancel every engine request of this submission that has not finished."""
        for c, rid in zip(self.choices, self.ids):
            if c.finish_reason is None:
                self.serving.runner.abort(rid)

    def apply(self, i: int, out: RequestOutput) -> _Choice:
        c = self.choices[i]
        t = time.monotonic()
        m = self.serving.metrics
        if out.new_token_ids:
            if c.first is None:
                c.first = t
                m.ttft.observe(t - self.arrival)
            elif c.last is not None:  # tokens delivered together share the gap
                gap = (t - c.last) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    m.itl.observe(gap)
            c.last = t
        c.text.append(out.new_text)
        c.tokens = out.num_output_tokens
        c.cached = out.num_cached_tokens
        if out.new_logprobs:
            c.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            c.finish_reason = out.finish_reason
            self.pending -= 1
            m.e2e.observe(t - self.arrival)
        return c

    async def next(self, gone: asyncio.Future | None = None) -> tuple[int, RequestOutput]:
        """The next output; ClientGone if ``gone`` (the client's disconnect) completes first."""
        if gone is None or not self.queue.empty():
            return await self.queue.get()
        get = asyncio.ensure_future(self.queue.get())
        await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            raise ClientGone()
        return get.result()

    def usage(self, n: int) -> dict[str, Any]:
        cached = sum(c.cached for c in self.choices[::n])  # once per prompt, as prompt_tokens
        return usage(self.prompt_tokens, sum(c.tokens for c in self.choices), cached)


class JSONText(str):
    """A response body already written as JSON text."""


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


_NO_SCORES = (np.zeros(0), np.zeros((0, 0), np.int64), np.zeros((0, 0)))  # an echo that was not scored


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


_HOLE = "\x00"  # stands for a token event's text in its template (JSON writes it as "\u0000")


class _Events:
    """A stream's SSE events. Most of a stream is token events that differ only in their text and
    choice index: each index's event is serialized once as a template, and a token's event is
    that template around ``json.dumps(text)``, the same bytes ``_sse`` writes for the whole event
    at a tenth of the cost (one stream's events are a third of the event loop's time per token at
    32 streams otherwise)."""

    def __init__(self, event: Callable[[int, str], dict[str, Any]], extra: dict[str, Any]) -> None:
        self.event, self.extra = event, extra
        self._templates: dict[int, tuple[str, str] | None] = {}

    def __call__(self, body: dict[str, Any]) -> str:
        return _sse({**body, **self.extra})

    def token(self, i: int, text: str) -> str:
        """The event of choice ``i``'s token ``text`` (no logprobs, no finish_reason)."""
        t = self._templates.get(i, False)
        if t is False:
            parts = self(self.event(i, _HOLE)).split(json.dumps(_HOLE))
            t = self._templates[i] = (parts[0], parts[1]) if len(parts) == 2 else None
        if t is None:  # the head itself holds the hole's text: no template
            return self(self.event(i, text))
        return t[0] + json.dumps(text) + t[1]


class Serving:
    """Engine glue for the OpenAI endpoints (HTTP-free: the app maps it to routes)."""

    def __init__(self, runner: EngineThread, *, max_queue: int = 256, metrics: Metrics | None = None) -> None:
        self.runner = runner
        self.engine = runner.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.created = now()
        self.max_queue = max_queue
        self.metrics = metrics or Metrics(self.engine.stats)
        self.closing = False
        self._mailbox: _Mailbox | None = None
        self.token_json = TokenJSON(self.tokenizer.token_text)  # completions logprobs' token texts

    def mailbox(self) -> _Mailbox:
        """The mailbox of the running event loop (made on first use; a new loop gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = _Mailbox(loop)
        return self._mailbox

    # ---- shared checks -------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return models_list(self.model_name, self.created, self.max_model_len)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                400,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    def _admit(self, count: int) -> None:
        if self.closing or not self.runner.alive:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        waiting = self.engine.stats()["waiting"]
        if waiting + count > self.max_queue:
            raise APIError(
                429,
                f"the server is busy: {waiting} requests are waiting (max_queue {self.max_queue}); "
                "retry later",
                type="rate_limit_error",
                code="queue_full",
            )

    def _params(
        self,
        req: Any,
        prompts: list[list[int]],
        max_tokens: int | None,
        prompt_param: str,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        ctx = self.max_model_len
        longest = max(len(p) for p in prompts)
        if longest + (max_tokens != 0) > ctx:
            raise APIError(
                400,
                f"This model's maximum context length is {ctx} tokens; the prompt has {longest} tokens"
                + (" (at least one new token must fit)" if max_tokens != 0 else ""),
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = ctx - longest
        elif longest + max_tokens > ctx:
            raise APIError(
                400,
                f"max_tokens is too large: {max_tokens} new tokens after a {longest}-token prompt exceed the "
                f"context of {ctx} tokens (at most {ctx - longest})",
                param="max_tokens",
                code="context_length_exceeded",
            )
        d = self.engine.generation_defaults
        vocab = self.engine.spec.vocab_size
        bad = next((t for t in req.stop_token_ids or [] if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400,
                f"stop_token_ids: {bad} is not a token id (vocabulary of {vocab})",
                param="stop_token_ids",
            )
        try:
            return SamplingParams(
                temperature=d.get("temperature", 1.0) if req.temperature is None else req.temperature,
                top_p=d.get("top_p", 1.0) if req.top_p is None else req.top_p,
                top_k=req.top_k or d.get("top_k", 0),
                min_p=req.min_p,
                repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                seed=req.seed,
                max_tokens=max_tokens,
                stop=tuple(req.stop),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None

    @staticmethod
    def _split_prompts(prompt: Any) -> list[str | list[int]]:
        """A request's prompts: one string or id list, or a list of them."""
        # (a validated Prompt: a list holds one kind of item, so its first says which)
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return prompts

    def _encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        vocab = self.engine.spec.vocab_size
        out = []
        for p in prompts:
            ids = self.engine.encode(p)  # the BOS rule: docs/serve.md
            if not ids:
                raise APIError(400, "prompt must not be empty", param="prompt")
            if min(ids) < 0 or max(ids) >= vocab:
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise APIError(
                    400, f"prompt: token id {bad} is out of range (vocabulary of {vocab})", param="prompt"
                )
            out.append(ids)
        return out

    # ---- /v1/completions -----------------------------------------------------------------------
    def _check_echo(self, req: CompletionRequest) -> None:
        if req.echo:
            for name, bad, why in (
                ("n", req.n > 1, f"n: {req.n} choices with echo: true are not supported (give n: 1)"),
                ("stream", req.stream, "stream: echo: true is not supported with stream: true"),
                (
                    "echo",
                    not self.engine.runner.can_score,
                    "echo: this model file has no score program (exported by an older llmkit); "
                    "export it again with llmkit export",
                ),
            ):
                if bad:
                    raise APIError(400, why, param=name)
        elif req.max_tokens == 0:
            raise APIError(
                400,
                "max_tokens: 0 scores the prompt without generating, which needs echo: true",
                param="max_tokens",
            )

    async def completions(self, req: CompletionRequest, disconnected: Disconnected) -> Any:
        self._check_model(req.model)
        self._check_echo(req)
        split = self._split_prompts(req.prompt)
        # Tokenizing runs on a worker thread (sentencepiece releases the GIL): a long prompt does
        # not hold up the event loop, which serves every other client. Token-id prompts (lm-eval's
        # scoring requests) are only checked, here: a thread hop would cost more than the check.
        if any(isinstance(p, str) for p in split):
            prompts = await asyncio.to_thread(self._encode_prompts, split)
        else:
            prompts = self._encode_prompts(split)
        max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
        # echo scores the prompt (its logprobs: the score program's top-k, k = logprobs)
        prompt_logprobs = (req.logprobs or 0) if req.echo else None
        params = self._params(req, prompts, max_tokens, "prompt", req.logprobs, prompt_logprobs)
        self._admit(len(prompts) * req.n)
        sub = _Submission(self, prompts, params, req.n)
        rid, created = new_id("cmpl"), now()
        texts = self.token_json
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if req.stream:

            def event(i: int, text: str, logprobs: Any = None, reason: str | None = None) -> dict[str, Any]:
                choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
                return {**head, "choices": [choice]}

            def chunks(ev: _Events, i: int, c: _Choice, out: RequestOutput) -> list[str]:
                if not (out.new_text or out.new_token_ids or out.finished):
                    return []
                if req.logprobs is None and c.finish_reason is None:
                    return [ev.token(i, out.new_text)]
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs(out.new_logprobs or [], texts, c.offset)
                return [ev(event(i, out.new_text, logprobs, c.finish_reason))]

            return self._stream(sub, event, chunks, head, req.include_usage, req.n)
        await self._collect(sub, disconnected)
        # The body is written here as JSON text: an echoed prompt's logprobs come as the score
        # program's arrays, and a dict per token only to serialize it was most of this request's time.
        choices = []
        for c in sub.choices:
            text, prompt = "".join(c.text), None
            if req.echo:  # one choice per prompt (n is 1)
                p = split[c.index]
                text = (p if isinstance(p, str) else self.tokenizer.decode(p)) + text
                prompt = c.prompt_logprobs or PromptLogprobs(prompts[c.index][:1], *_NO_SCORES)
            logprobs = "null"
            if req.logprobs is not None:
                logprobs = completion_logprobs_json(texts, c.logprobs, prompt)
            choices.append(
                f'{{"index":{c.index},"text":{_dumps(text)},"finish_reason":{_dumps(c.finish_reason)},'
                f'"logprobs":{logprobs}}}'
            )
        return JSONText(
            f'{_dumps(head)[:-1]},"choices":[{",".join(choices)}],"usage":{_dumps(sub.usage(req.n))}}}'
        )

    # ---- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, disconnected: Disconnected) -> Any:
        self._check_model(req.model)
        # what the template sees: each message's role, text and (when given) name
        messages = [{"role": m.role, "content": m.text(), "name": m.name} for m in req.messages]
        try:
            ids = await asyncio.to_thread(self.engine.chat_template.render, messages, self.tokenizer)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, [ids], req.token_limit, "messages", top)
        self._admit(req.n)
        sub = _Submission(self, [ids], params, req.n)
        rid, created = new_id("chatcmpl"), now()
        tok = self.tokenizer
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
            "system_fingerprint": None,
        }

        def lp(tokens: list[Any]) -> dict[str, Any] | None:
            return chat_logprobs(tokens, tok.token_text, tok.token_bytes) if req.logprobs else None

        if req.stream:

            def event(i: int, text: str, logprobs: Any = None) -> dict[str, Any]:
                choice = {"index": i, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
                return {**head, "choices": [choice]}

            def chunks(ev: _Events, i: int, c: _Choice, out: RequestOutput) -> list[str]:
                out_chunks = []
                if out.new_text or (req.logprobs and out.new_token_ids):
                    if req.logprobs:
                        out_chunks.append(ev(event(i, out.new_text, lp(out.new_logprobs or []))))
                    else:
                        out_chunks.append(ev.token(i, out.new_text))
                if out.finished:
                    finish = {"index": i, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}
                    out_chunks.append(ev({**head, "choices": [finish]}))
                return out_chunks

            first = [
                {
                    **head,
                    "choices": [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                for c in sub.choices
            ]
            return self._stream(sub, event, chunks, head, req.include_usage, req.n, first)
        await self._collect(sub, disconnected)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text), "refusal": None},
                "logprobs": lp(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in sub.choices
        ]
        return {**head, "object": "chat.completion", "choices": choices, "usage": sub.usage(req.n)}

    # ---- collecting and streaming --------------------------------------------------------------
    async def _collect(self, sub: _Submission, disconnected: Disconnected | None) -> None:
        # one watcher of the client per request (polling it 4 times a second cost the event loop
        # about a tenth of its time with 64 echo requests waiting)
        gone = None if disconnected is None else asyncio.ensure_future(disconnected())
        try:
            while not sub.done:
                sub.apply(*await sub.next(gone))
        except BaseException:
            sub.abort()
            raise
        finally:
            if gone is not None:
                gone.cancel()
        self._raise_failed(sub)

    def _raise_failed(self, sub: _Submission) -> None:
        if any(c.finish_reason == FinishReason.ERROR for c in sub.choices):
            raise APIError(500, "the engine failed while generating; see the server log", type="server_error")

    def _stream(
        self,
        sub: _Submission,
        event: Callable[[int, str], dict[str, Any]],
        chunks: Callable[[_Events, int, _Choice, RequestOutput], list[str]],
        head: dict[str, Any],
        include_usage: bool,
        n: int,
        first: list[dict[str, Any]] = (),  # type: ignore[assignment]
    ) -> AsyncIterator[str]:
        ev = _Events(event, {"usage": None} if include_usage else {})

        async def gen() -> AsyncIterator[str]:
            # Events that are ready together go out as one body write (one send): the outputs
            # already queued, and the last token with the finish chunk, usage and [DONE].
            try:
                events = [ev(body) for body in first]  # chat: the role comes first
                while not sub.done:
                    if events and sub.queue.empty():
                        yield "".join(events)
                        events = []
                    i, out = await sub.next()  # (at once when one is queued)
                    c = sub.apply(i, out)
                    if c.finish_reason == FinishReason.ERROR:
                        msg = "the engine failed while generating; see the server log"
                        events.append(_sse(error_body(msg, "server_error")))
                        break
                    events += chunks(ev, i, c, out)
                    c.offset += len(out.new_text)
                else:
                    if include_usage:
                        events.append(_sse({**head, "choices": [], "usage": sub.usage(n)}))
                events.append("data: [DONE]\n\n")
                yield "".join(events)
            finally:
                if not sub.done:
                    sub.abort()

        return gen()
