"""KV block bookkeeping: allocation, freeing, admission, prefix caching, eviction."""

from __future__ import annotations

import pytest

from llmkit.infer.blocks import BlockManager


def test_allocate_free_and_admission():
    bm = BlockManager(num_blocks=5, block_size=4)
    a = bm.admit(list(range(6)), total_tokens=10)  # 3 blocks
    assert len(a.blocks) == 3 and a.cached_tokens == 0 and bm.num_used == 3
    assert bm.admit(list(range(20, 26)), total_tokens=10) is None  # 2 free < 3 needed: nothing changes
    assert bm.num_used == 3
    b = bm.admit([7, 8], total_tokens=8)
    assert len(set(a.blocks) | set(b.blocks)) == 5 and bm.num_free == 0
    bm.free(a.blocks)
    bm.free(b.blocks)
    assert bm.num_used == 0 and bm.num_free == 5
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(b.blocks)
    with pytest.raises(ValueError, match="needs 6 KV blocks; the pool has 5"):
        bm.admit([1], total_tokens=21)


def test_prefix_hits_share_full_blocks_and_keep_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    a = bm.admit(prompt, total_tokens=20)
    for i, h in enumerate(a.hashes):  # the prefill computed them
        bm.register(a.blocks[i], h)
    same = bm.admit(prompt, total_tokens=20)
    assert same.cached_tokens == 12 and same.blocks[:3] == a.blocks[:3]
    assert bm.prefix_hits == 3
    exact = bm.admit(prompt[:12], total_tokens=16)  # 12 tokens: the last block is recomputed
    assert exact.cached_tokens == 8
    other = bm.admit(list(range(100, 104)) + [0] * 9, total_tokens=20)  # shares only the first block
    assert other.cached_tokens == 4
    for x in (a, same, exact, other):
        bm.free(x.blocks)
    assert bm.num_used == 0 and bm.num_cached == 3


def test_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.admit([1, 2, 3], total_tokens=4)  # 2 blocks, 1 full prompt block
    bm.register(a.blocks[0], a.hashes[0])
    bm.free(a.blocks)
    assert bm.num_free == 4 and bm.num_cached == 1
    big = bm.admit([9, 9, 9], total_tokens=8)  # needs all 4: evicts the cached one
    assert big is not None and bm.num_cached == 0
    bm.free(big.blocks)
    again = bm.admit([1, 2, 3], total_tokens=4)
    assert again.cached_tokens == 0


def test_reset_and_disabled_prefix_cache():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.admit([1, 2, 3], total_tokens=4)
    bm.register(a.blocks[0], a.hashes[0])
    bm.reset_prefix_cache()
    bm.free(a.blocks)
    assert bm.num_cached == 0 and bm.admit([1, 2, 3], total_tokens=4).cached_tokens == 0
    off = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    b = off.admit([1, 2, 3], total_tokens=4)
    off.register(b.blocks[0], b"x")
    assert off.num_cached == 0 and b.hashes == []


def test_the_pool_grows_with_the_most_blocks_in_use_at_once():
    """Blocks never written cost no memory (the pool is committed lazily): the blocks handed out stay
    those of the busiest moment, freed ones (lowest first) and then cached prefixes going first."""
    bm = BlockManager(num_blocks=64, block_size=2)
    assert bm.num_touched == 0 and bm.num_free == 64
    for wave in range(10):  # 3 sequences of 3 blocks at once, each wave with new prompts
        seqs = [bm.admit([wave, k, 7, 7, 7], total_tokens=6) for k in range(3)]
        for s in seqs:
            for b, h in zip(s.blocks, s.hashes):
                bm.register(b, h)
        assert bm.num_touched == 9 and sorted(b for s in seqs for b in s.blocks) == list(range(9))
        for s in seqs:
            bm.free(s.blocks)
    assert bm.num_cached == 6  # the last wave's prefixes; older ones made way
    big = bm.admit([1] * 21, total_tokens=22)  # 11 blocks: 3 freed, 6 cached evicted, 2 new
    assert bm.num_touched == 11 and bm.num_cached == 0
    assert bm.admit([2], total_tokens=2 * 53) is not None and bm.num_free == 0  # up to the cap
    bm.free(big.blocks)
    assert sorted(bm._free) == list(range(11)) and bm.num_free == 11
