"""The OpenAI wire format: request models (validated with pydantic) and response builders.

Requests reject unknown fields and out-of-range values with a 400 naming the field (OpenAI's own
ranges; ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids`` and ``ignore_eos`` are
accepted as vLLM-style extensions). Responses are plain dicts built here, in OpenAI's shapes:
``text_completion`` / ``chat.completion`` objects, their ``*.chunk`` streaming forms, ``usage``,
``logprobs`` and the error body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmkit.infer.sampling import PromptLogprobs

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop strings per request (OpenAI's limit)


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- requests ------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # extensions (as in vLLM)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> None:
        if v:
            raise ValueError("logit_bias is not supported")
        return None

    @model_validator(mode="after")
    def _stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, score the prompt only
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False  # the prompt (and its tokens' logprobs) before the completion
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # accepted and ignored: they change nothing here
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses -----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class TokenJSON(dict):
    """Token id -> (its text as completions logprobs show it, as JSON; that text's length), made
    from ``text_of`` (``Tokenizer.token_text``) the first time the id is met."""

    def __init__(self, text_of: Callable[[int], str]) -> None:
        super().__init__()
        self.text_of = text_of

    def __missing__(self, t: int) -> tuple[str, int]:
        text = self.text_of(t)
        v = self[t] = (json.dumps(text, ensure_ascii=False), len(text))
        return v


def completion_logprobs_json(
    texts: TokenJSON, tokens: Sequence[Any] = (), prompt: PromptLogprobs | None = None, offset: int = 0
) -> str:
    """Legacy completions ``logprobs`` as JSON text: an echoed ``prompt``'s tokens (its first one
    with ``null`` logprob and top: nothing predicts it), then the TokenChoices ``tokens``; ``offset``
    is where their text starts. Each top lists the k most likely tokens, most likely first (a text
    two tokens share keeps the likelier), and the chosen token. Written from columns (the prompt's
    as the score program's arrays), each number formatted once as ``json.dumps`` writes it: the echo
    response's bulk, where a dict per token to serialize cost most of a request's time."""
    ids: list[int] = []
    lps: list[float] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    same: list[bool] = []  # the most likely token is the chosen one, with the same number
    finite, k = True, None
    if prompt is not None:
        ids, lps = list(prompt.ids), prompt.logprobs.tolist()
        top_ids, top_lps = prompt.top_ids.tolist(), prompt.top_logprobs.tolist()
        finite = bool(np.isfinite(prompt.logprobs).all() and np.isfinite(prompt.top_logprobs).all())
        k = prompt.top_ids.shape[1]
        if k:
            best, best_lp = prompt.top_ids[:, 0], prompt.top_logprobs[:, 0]
            same = ((best == np.asarray(ids[1:], np.int64)) & (best_lp == prompt.logprobs)).tolist()
    for c in tokens:
        ids.append(c.token_id)
        lps.append(c.logprob)
        top_ids.append([t for t, _ in c.top])
        top_lps.append([lp for _, lp in c.top])
        same.append(bool(c.top) and c.top[0] == (c.token_id, c.logprob))
        finite = finite and all(map(math.isfinite, (c.logprob, *top_lps[-1])))
        k = len(c.top) if k in (None, len(c.top)) else -1
    first = int(prompt is not None)  # positions before ``first`` have no logprob
    num = float.__repr__ if finite else json.dumps  # the same text for finite floats
    tj = [texts[t] for t in ids]
    chosen, lp_s = [j for j, _ in tj[first:]], list(map(num, lps))
    if k == 1:  # lm-eval's request: no dict per position
        top_j = [texts[row[0]][0] for row in top_ids]
        tops = [
            f"{{{c}:{w}}}" if s else f"{{{j}:{num(row[0])}}}" if j == c else f"{{{j}:{num(row[0])},{c}:{w}}}"
            for j, row, c, w, s in zip(top_j, top_lps, chosen, lp_s, same)
        ]
    else:
        tops = []
        for c, w, row, vals in zip(chosen, lp_s, top_ids, top_lps):
            top: dict[str, str] = {}
            for t, v in zip(row, vals):
                top.setdefault(texts[t][0], num(v))
            top.setdefault(c, w)
            tops.append("{" + ",".join([f"{k}:{v}" for k, v in top.items()]) + "}")
    offsets = ",".join(map(str, accumulate([n for _, n in tj[:-1]], initial=offset))) if tj else ""
    nulls = ["null"] * first
    return (
        f'{{"tokens":[{",".join([j for j, _ in tj])}],"token_logprobs":[{",".join(nulls + lp_s)}],'
        f'"top_logprobs":[{",".join(nulls + tops)}],"text_offset":[{offsets}]}}'
    )


def completion_logprobs(tokens: list[Any], texts: TokenJSON, offset: int) -> dict[str, Any]:
    """:func:`completion_logprobs_json`'s object for TokenChoices, as a dict (a streamed chunk's)."""
    return json.loads(completion_logprobs_json(texts, tokens, offset=offset))


def chat_logprobs(tokens: list[Any], text_of: Any, bytes_of: Any) -> dict[str, Any]:
    """Chat ``logprobs`` ({"content": [...]}) for TokenChoices."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        return {"token": text_of(t), "logprob": lp, "bytes": list(bytes_of(t))}

    return {
        "content": [
            {**entry(c.token_id, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top]}
            for c in tokens
        ],
        "refusal": None,
    }


def models_list(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "llmkit",
                "max_model_len": max_model_len,
            }
        ],
    }
