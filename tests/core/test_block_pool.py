from __future__ import annotations

import pytest

from tokenmill.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens


def test_free_queue_is_lru_and_o1_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 4, 0]
    with pytest.raises(ValueError):
        q.remove(blocks[2])


def test_hash_chains_parent_and_extra_keys():
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(None, (1, 2, 3))
    assert hash_block_tokens(a, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(None, [1, 2, 3], ("salt",)) != a


def test_get_new_blocks_evicts_cached_hash_and_double_free_is_caught():
    pool = BlockPool(3, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_block(b, h)
    assert pool.get_cached_block(h) is b
    pool.free_blocks([b])
    assert pool.get_cached_block(h) is b  # freed but still cached
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b])
    taken = pool.get_new_blocks(3)  # the cached block is evicted when handed out again
    assert pool.get_cached_block(h) is None and b in taken
    pool.free_blocks(taken)
    with pytest.raises(AssertionError):
        pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_usage() == 0.0
