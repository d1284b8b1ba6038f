"""Rollouts on the inference engine, bound to the live policy.

``Engine.from_model(policy)`` traces the engine's prefill and decode programs once; they read the
policy's parameters at every call, so after an optimizer step the next rollout samples from the
new weights with nothing copied (with ``exact``, the programs read the parameters' own arrays;
otherwise the engine's relaid copies are rebuilt, and ``sync`` times that). A step's prompts, each
sampled ``n`` times, are queued at once and run as one continuously batched set; every request has
its own seed, a function of (run seed, step, index), so a resumed run samples what it would have.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmkit.infer import Engine, EngineConfig, SamplingParams

from .data import Prompt, encode_prompt


@dataclass
class RolloutBatch:
    """A step's completions, prompt-major (prompt i's samples are rows i*n .. i*n+n-1)."""

    prompt_ids: list[list[int]]  # with BOS
    completion_ids: list[list[int]]  # sampled tokens, the stop token included when one ended it
    texts: list[str]  # completions as text (without the stop token)
    logprobs: list[list[float]]  # the engine's log-prob of each sampled token (at the temperature)
    seconds: float  # wall time of the generation

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.completion_ids))

    def token_array(self, width: int) -> np.ndarray:
        """The engine's log-probs in the training layout: [B, width], at position p_len - 1 + j for
        completion token j (where the trainer's log-prob of that token sits), zero elsewhere."""
        out = np.zeros((len(self.prompt_ids), width), np.float64)
        for b, (p, lp) in enumerate(zip(self.prompt_ids, self.logprobs)):
            out[b, len(p) - 1 : len(p) - 1 + len(lp)] = lp
        return out


def request_seed(seed: int, step: int, index: int) -> int:
    """A request's sampling seed: distinct for every (run seed, step, index)."""
    return int(np.random.SeedSequence([seed, step, index]).generate_state(1, np.uint64)[0])


class Rollouts:
    """Sampling completions for the policy, on an engine over its live weights."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_tokens: int,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        max_batch: int = 64,
        max_prompt_tokens: int = 128,
        exact: bool = True,
        compiler: str | None = None,
    ) -> None:
        limit = model.config.max_position_embeddings
        if max_tokens >= limit:
            raise ValueError(f"rollout.max_tokens ({max_tokens}) must be below the model's context ({limit})")
        self.max_prompt_tokens = min(max_prompt_tokens, limit - max_tokens)
        self.tokenizer = tokenizer
        self.params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=0,
            logprobs_mode="processed",
        )
        config = EngineConfig(
            max_batch=max_batch,
            max_tokens_per_step=max(256, max_batch),
            max_model_len=self.max_prompt_tokens + max_tokens,
            relayout_weights=not exact,
            compiler=compiler,
        )
        self.engine = Engine.from_model(model, tokenizer, config)

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's tokens (a text with BOS, a conversation through the chat template:
        :func:`encode_prompt`); a longer prompt keeps its first token (BOS) and its last tokens."""
        ids = encode_prompt(self.tokenizer, prompt)
        if len(ids) > self.max_prompt_tokens:
            ids = ids[:1] + ids[len(ids) - self.max_prompt_tokens + 1 :]
        return ids

    def generate(
        self, prompts: Sequence[Prompt], n: int, seed: int, step: int, first: int = 0
    ) -> RolloutBatch:
        """``n`` completions of each prompt, all queued at once (one continuously batched set);
        ``first``: the index of the first request in the step's batch (a data-parallel rank's rows
        sample what they would in one process)."""
        ids = [self.encode(p) for p in prompts for _ in range(n)]
        params = [self.params.replace(seed=request_seed(seed, step, first + i)) for i in range(len(ids))]
        t0 = time.perf_counter()
        done = self.engine.generate(ids, params)
        seconds = time.perf_counter() - t0
        return RolloutBatch(
            prompt_ids=ids,
            completion_ids=[list(c.token_ids) for c in done],
            texts=[c.text for c in done],
            logprobs=[[t.logprob for t in c.logprobs] for c in done],
            seconds=seconds,
        )

    def sync(self) -> float:
        """After an optimizer step: forget cached prefixes and any weights derived from the old
        ones; returns the seconds it took (with ``exact``, no copy is made: the programs read the
        parameters themselves)."""
        t0 = time.perf_counter()
        self.engine.weights_changed()
        self.engine.runner.refresh_weights()
        return time.perf_counter() - t0
