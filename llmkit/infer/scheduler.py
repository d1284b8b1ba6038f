"""Continuous batching: which requests run in the next step, and which prompt chunks they prefill.

Between two steps, requests join (admitted first come, first served, while the KV pool has their
blocks and, for a request that will decode, fewer than ``max_batch`` decoding requests run) and leave
(finished or cancelled). A *prefill-only* request (``max_tokens`` 0 or 1: scoring, or one token that
prefill's logits give) never takes a decode slot; such requests are admitted while the prompt
tokens still to compute fit one step's budget, so a step prefills as many of them as fit. A step
decodes one token for every running request whose prompt is done, and spends the rest of
``max_tokens_per_step`` on prompt chunks. Chunks are *aligned*: chunk ``c`` of a prompt is always
positions ``[c*C, (c+1)*C)`` (C = ``chunk_size``, a divisor of the block size), clipped to the
prompt; a prefix-cache hit skips whole blocks, so a prompt is computed in the same chunks whether
it runs alone, in a batch, or after a hit (batch invariance, docs/serve.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .blocks import BlockManager
from .request import Request


@dataclass
class StepPlan:
    """One step's work: decode tokens and prompt chunks ``(request, start, num_tokens)``."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[tuple[Request, int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


def _prefill_only(req: Request) -> bool:
    """Whether a request ends when its prompt is computed (it never decodes)."""
    return req.params.max_tokens <= 1


class Scheduler:
    """FIFO admission, per-step token budget, aligned prompt chunks."""

    def __init__(
        self, blocks: BlockManager, max_batch: int, max_tokens_per_step: int, chunk_size: int
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if chunk_size < 1 or blocks.block_size % chunk_size:
            raise ValueError(f"chunk_size ({chunk_size}) must divide the block size ({blocks.block_size})")
        if max_tokens_per_step < max_batch + chunk_size:
            raise ValueError(
                f"max_tokens_per_step ({max_tokens_per_step}) must be at least max_batch + chunk_size "
                f"({max_batch + chunk_size}): a full batch must still make prefill progress"
            )
        self.blocks = blocks
        self.max_batch, self.max_tokens_per_step, self.chunk_size = max_batch, max_tokens_per_step, chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or cancelled) and release its blocks."""
        if req in self.running:
            self.running.remove(req)
            self.blocks.free(req.blocks)
            req.blocks = []
        elif req in self.waiting:
            self.waiting.remove(req)

    def _admit(self) -> None:
        decoding = sum(not _prefill_only(r) for r in self.running)
        pending = sum(r.prompt_len - r.computed for r in self.running)  # prompt tokens to compute
        while self.waiting:
            req = self.waiting[0]
            if _prefill_only(req) and pending >= self.max_tokens_per_step:
                return  # first come, first served: later requests wait too
            if not _prefill_only(req) and decoding >= self.max_batch:
                return
            alloc = self.blocks.admit(req.prompt_ids, req.max_total_tokens, use_cache=not req.scores_prompt)
            if alloc is None:
                return
            self.waiting.popleft()
            decoding += not _prefill_only(req)
            pending += req.prompt_len - alloc.cached_tokens
            req.blocks, req.prefix_hashes = alloc.blocks, alloc.hashes
            req.computed = req.cached_tokens = alloc.cached_tokens
            req.registered = alloc.cached_tokens // self.blocks.block_size
            self.running.append(req)

    def schedule(self) -> StepPlan:
        self._admit()
        plan = StepPlan(decode=[r for r in self.running if r.prefilled and not r.finished])
        budget = self.max_tokens_per_step - len(plan.decode)
        c = self.chunk_size
        for req in self.running:
            pos = req.computed
            while pos < req.prompt_len:
                end = min(req.prompt_len, (pos // c + 1) * c)  # the next aligned chunk boundary
                if end - pos > budget:
                    return plan
                plan.prefill.append((req, pos, end - pos))
                budget -= end - pos
                pos = end
        return plan
