"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, prefix caching.

The pool holds ``num_blocks`` blocks of ``block_size`` token slots each. A sequence owns a block
table; :meth:`BlockManager.admit` gives it every block it can ever need (prompt + max new tokens)
at admission, so a running sequence never runs out of cache and is never preempted (preemption
by recomputation would change its numbers, see docs/serve.md). Admission is refused, and the
request waits, while too few blocks are free.

Prefix caching: a *full* prompt block is identified by a hash chained over every token up to its
end (sha256, so equal hashes mean equal prefixes). Once computed it is registered; a later
sequence whose prompt starts with the same blocks shares them (reference counted, read-only) and
skips their prefill. At least one prompt token is always recomputed (its logits start decoding).
A shared block whose last user finished stays cached and *evictable*.

Memory grows with the work: the pool is one lazily committed allocation (the OS gives a page memory
at its first write), and blocks are handed out so that the set ever written stays as small as the
work allows: a freed block first (lowest first), else the least recently freed evictable block,
and only when neither is left a block never used before. Resident memory thus follows the most
blocks in use at once, up to the pool's size (the cap: ``--num-blocks``); cached prefixes keep the
blocks that work freed, and give them back before the pool grows.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Allocation:
    """What :meth:`BlockManager.admit` returns: the block table and how much of the prompt is cached."""

    blocks: list[int]
    cached_tokens: int  # a multiple of block_size: these prompt positions are already in the pool
    hashes: list[bytes]  # of the prompt's full blocks, to register them once computed


class BlockManager:
    """Allocation, freeing and prefix caching of KV blocks (host bookkeeping only)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: list[int] = []  # freed blocks (a heap: lowest first)
        self._fresh = 0  # blocks _fresh.. were never handed out (their memory is not committed yet)
        self._ref = [0] * num_blocks
        self._cached: dict[bytes, int] = {}  # prefix hash -> block
        self._hash_of: dict[int, bytes] = {}  # block -> its prefix hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody uses, LRU first
        self.prefix_queries = 0  # full prompt blocks looked up
        self.prefix_hits = 0  # ... and found

    # ---- state --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a new sequence can get (free, or cached but unused)."""
        return len(self._free) + len(self._evictable) + self.num_blocks - self._fresh

    @property
    def num_used(self) -> int:
        """Blocks held by sequences."""
        return self.num_blocks - self.num_free

    @property
    def num_touched(self) -> int:
        """Blocks ever handed out (the pool's memory in use: the rest was never written)."""
        return self._fresh

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix (used or not)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix hashes ------------------------------------------------------------------------
    def prefix_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """One hash per full block of ``token_ids``, each covering every token up to the block's end."""
        bs = self.block_size
        out: list[bytes] = []
        h = b""
        for i in range(len(token_ids) // bs):
            chunk = np.asarray(token_ids[i * bs : (i + 1) * bs], dtype="<i8").tobytes()
            h = hashlib.sha256(h + chunk).digest()
            out.append(h)
        return out

    # ---- admission ----------------------------------------------------------------------------
    def admit(
        self, prompt_ids: Sequence[int], total_tokens: int, use_cache: bool = True
    ) -> Allocation | None:
        """Blocks for a sequence of up to ``total_tokens`` tokens starting with ``prompt_ids``, sharing
        its longest cached prefix (none with ``use_cache=False``: a prompt to score is computed whole;
        its blocks are still registered for others); None when not enough blocks are free (nothing
        changes then)."""
        n_total = self.blocks_for(total_tokens)
        if n_total > self.num_blocks:
            raise ValueError(
                f"a sequence of {total_tokens} tokens needs {n_total} KV blocks; "
                f"the pool has {self.num_blocks}"
            )
        hashes = self.prefix_hashes(prompt_ids) if self.enable_prefix_caching else []
        hits: list[int] = []
        # keep >= 1 prompt token to compute
        usable = (len(prompt_ids) - 1) // self.block_size if use_cache else 0
        for h in hashes[:usable]:
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        need = n_total - len(hits)
        if need > self.num_free - sum(1 for b in hits if b in self._evictable):
            return None
        self.prefix_queries += min(usable, len(hashes))
        self.prefix_hits += len(hits)
        for b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        blocks = hits + [self._take() for _ in range(need)]
        return Allocation(blocks, len(hits) * self.block_size, hashes)

    def _take(self) -> int:
        if self._free:
            b = heapq.heappop(self._free)
        elif self._evictable:  # evict the least recently freed cached block
            b, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(b)]
        else:  # the pool grows
            b, self._fresh = self._fresh, self._fresh + 1
        self._ref[b] = 1
        return b

    def register(self, block: int, prefix_hash: bytes) -> None:
        """Record that ``block`` now holds the (fully computed) prefix ``prefix_hash``."""
        if not self.enable_prefix_caching or prefix_hash in self._cached or block in self._hash_of:
            return  # an equal prefix is cached already (computed twice at once): keep the first
        self._cached[prefix_hash] = block
        self._hash_of[block] = prefix_hash

    def free(self, blocks: Sequence[int]) -> None:
        """Release a sequence's blocks (shared ones only lose a reference)."""
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    heapq.heappush(self._free, b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (call after changing the model's weights)."""
        for b in self._evictable:
            heapq.heappush(self._free, b)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of.clear()
