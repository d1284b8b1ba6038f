"""A request's life in the engine, and what the engine reports about it.

``Request`` is engine-internal state; ``RequestOutput`` is what a streaming callback receives after
every step that changed the request (new tokens, or its end); ``Completion`` is a finished
request as ``Engine.generate`` returns it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .detokenize import Detokenizer
from .sampling import PromptLogprobs, Sampler, SamplingParams, TokenChoice


class FinishReason:
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the model's context is full
    ABORT = "abort"  # cancelled (abort(), a client that went away, shutdown)
    ERROR = "error"  # the engine failed while running it


@dataclass
class RequestOutput:
    """One step's news about a request (deltas: concatenate them for the whole output)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenChoice] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # with params.prompt_logprobs: every prompt token's (None for the first), in the output of the
    # step that finished the prompt; None otherwise
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class Completion:
    """A finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenChoice] | None
    num_cached_tokens: int
    prompt_logprobs: PromptLogprobs | None = None  # with params.prompt_logprobs


@dataclass(eq=False)
class Request:
    """Engine-side state of one request (owned by the engine thread)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    detok: Detokenizer
    stop_ids: frozenset[int]
    callback: Callable[[RequestOutput], None] | None = None
    arrival: float = field(default_factory=time.monotonic)
    blocks: list[int] = field(default_factory=list)
    prefix_hashes: list[bytes] = field(default_factory=list)
    registered: int = 0  # full prompt blocks registered in the prefix cache
    computed: int = 0  # positions whose K/V are in the pool
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenChoice] = field(default_factory=list)
    finish_reason: str | None = None
    # params.prompt_logprobs: the score program's rows of each prompt chunk scored so far
    # (target logprobs [n], top ids [n, k], top logprobs [n, k])
    prompt_scores: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    prompt_reported: bool = False  # prompt_logprobs went out in a RequestOutput
    # this step's news, flushed into a RequestOutput after the step
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list[TokenChoice] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_len + self.params.max_tokens

    @property
    def prefilled(self) -> bool:
        return self.computed >= self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def scores_prompt(self) -> bool:
        return self.params.prompt_logprobs is not None

    def prompt_logprobs(self) -> PromptLogprobs:
        k = self.params.prompt_logprobs or 0
        parts = self.prompt_scores or [(np.zeros(0), np.zeros((0, k), np.int64), np.zeros((0, k)))]
        return PromptLogprobs(self.prompt_ids, *(np.concatenate(p) for p in zip(*parts)))

    def take_output(self) -> RequestOutput:
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.pending_ids,
            new_text=self.pending_text,
            new_logprobs=self.pending_logprobs if self.params.logprobs is not None else None,
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.prompt_len,
            num_output_tokens=len(self.output_ids),
            num_cached_tokens=self.cached_tokens,
        )
        if self.scores_prompt and self.prefilled and not self.prompt_reported:
            out.prompt_logprobs, self.prompt_reported = self.prompt_logprobs(), True
        self.pending_ids, self.pending_text, self.pending_logprobs = [], "", []
        return out

    def completion(self) -> Completion:
        return Completion(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=self.output_ids,
            text=self.detok.text,
            finish_reason=self.finish_reason or FinishReason.ABORT,
            logprobs=self.logprobs if self.params.logprobs is not None else None,
            num_cached_tokens=self.cached_tokens,
            prompt_logprobs=self.prompt_logprobs() if self.scores_prompt else None,
        )
