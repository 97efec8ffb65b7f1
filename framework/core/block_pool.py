"""BlockPool: every KV-cache block, an O(1) LRU free queue and the prefix-cache hash map.

A block with ``ref_cnt == 0`` sits in the free queue. If it holds a full block of tokens that was hashed,
its hash stays in the map until the block is handed out again, so a later request with the same prefix can
take it back out of the free queue (a prefix-cache hit). Eviction order is the free queue's order: least
recently freed first; within one request, its tail blocks are freed first so they are evicted first.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Hash of one full block, chained to its parent's hash (16 bytes, BLAKE2b).

    Chaining makes the hash identify the whole prefix up to and including this block, so equal hashes mean
    equal prefixes (up to hash collisions, 2^-128). ``extra_keys`` (e.g. a cache salt) separate otherwise
    equal prefixes.
    """
    payload = pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5)
    return hashlib.blake2b(payload, digest_size=16).digest()


class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's KV cache.

    Attributes:
        block_id: index into the per-layer KV tensors.
        ref_cnt: number of requests using the block.
        block_hash: hash of the full block's contents, when cached.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the front, append and removal from the middle."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    """Owns all ``num_blocks`` blocks.

    Args:
        num_blocks: blocks in the KV cache.
        enable_caching: keep hashes of full blocks for prefix caching.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record that ``block`` holds the full block identified by ``block_hash``."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return  # an identical block is already cached; this one stays private and is not shared
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue (evicting their cached hashes).

        Raises:
            ValueError: fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks, {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (removing free ones from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue in the given order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use. Returns whether it happened."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks
