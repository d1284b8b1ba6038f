"""Continuous batching: which requests run in the next step, and which prompt chunks they prefill.

Between two steps, requests join (admitted first come, first served, while fewer than
``max_batch`` run and the KV pool has their blocks) and leave (finished or cancelled). A step
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
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            alloc = self.blocks.admit(req.prompt_ids, req.max_total_tokens)
            if alloc is None:
                return  # first come, first served: later requests wait too
            self.waiting.popleft()
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
