"""KVCacheManager: which blocks a request already has cached, slots for new tokens, and freeing."""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to blocks of the paged KV cache.

    Args:
        num_blocks: blocks in the cache.
        block_size: token slots per block.
        enable_caching: prefix caching (share full blocks with equal prefixes).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        extra = request.block_hash_extra_keys
        bs = self.block_size
        while (len(hashes) + 1) * bs <= request.num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            block_extra = extra
            if request.mm_features:
                images = request.block_mm_hashes(i * bs, (i + 1) * bs)
                if images:
                    block_extra = (*extra, ("mm", images))
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs], block_extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute (the model must produce logits for the last one), so a
        prompt whose every block is cached hits ``(num_tokens - 1) // block_size`` blocks at most.

        This only looks: it changes no reference count and no statistic, so the scheduler may ask again every
        step while the request waits. It reports the lookup with :meth:`record_prefix_cache_lookup` once the
        request is admitted.

        Returns:
            (blocks, number of tokens they hold). The blocks are not yet referenced: pass them to
            :meth:`allocate_slots`.
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_cache_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (once per admission, not per attempt).

        Args:
            num_queried_tokens: the tokens looked up (the request's prompt, plus outputs after a preemption).
            num_hit_tokens: of those, the tokens served by the cache.
        """
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens fits in the whole cache."""
        return cdiv(num_tokens, self.block_size) <= self.num_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's computed (and cache-hit) tokens.

        ``num_lookahead_tokens`` more slots are reserved after those (a draft model's KV for tokens not yet
        scheduled); they are never hashed for prefix caching, which covers only ``request.all_token_ids``.

        Returns:
            the newly allocated blocks, or ``None`` (nothing changed) when not enough blocks are free.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = cdiv(total_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Cache hits that are currently free come out of the free queue too.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.block_pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(total_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_known_tokens: int) -> None:
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_known_tokens // self.block_size
        if end <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, end):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so its last blocks are evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_state_slot(self, request_id: str) -> int | None:
        """The request's state slot; ``None`` here (no state layers; see ``HybridKVCacheCoordinator``)."""
        return None

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(queried tokens, hit tokens) since the last call."""
        stats = (self.prefix_cache_queries, self.prefix_cache_hits)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return stats
