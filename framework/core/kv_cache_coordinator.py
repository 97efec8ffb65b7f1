"""HybridKVCacheCoordinator: the KV cache of a model with both attention layers and state layers.

After vLLM's hybrid KV-cache manager (one manager per cache kind under a coordinator): the attention layers'
paged blocks stay with :class:`~tokenmill.core.kv_cache_manager.KVCacheManager` (this class extends it, so the
scheduler talks to one object), and the state layers' slots with a
:class:`~tokenmill.core.state_cache_manager.MambaManager`. A request gets its slot with its first blocks and
both are released together (finish, abort, preemption). Prefix caching is off for these models: a cached
prefix would need the state after that prefix too (see docs/architecture.md, "The hybrid cache").

For an attention-free model (Mamba2) the blocks only count tokens: no block is handed out and any sequence
up to the context length fits.
"""

from __future__ import annotations

from tokenmill.config import CacheConfig
from tokenmill.core.block_pool import KVCacheBlock
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.state_cache_manager import MambaManager


class HybridKVCacheCoordinator(KVCacheManager):
    """Args:
    num_blocks, block_size: the attention layers' paged cache (see :class:`KVCacheManager`).
    num_state_slots: state slots (one per running request).
    attention_free: the model has no attention layer (blocks are not handed out).
    """

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, attention_free: bool = False) -> None:
        super().__init__(num_blocks, block_size, enable_caching=False)
        self.mamba_manager = MambaManager(num_state_slots)
        self.attention_free = attention_free

    def can_fit(self, num_tokens: int) -> bool:
        return True if self.attention_free else super().can_fit(num_tokens)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """As :meth:`KVCacheManager.allocate_slots`, and a state slot for a request that has none; ``None``
        (nothing changed) when either is short."""
        had_slot = self.mamba_manager.has_slot(request.request_id)
        if self.mamba_manager.allocate(request.request_id) is None:
            return None
        if self.attention_free:
            self.req_to_blocks.setdefault(request.request_id, [])
            return []
        blocks = super().allocate_slots(request, num_new_tokens, new_computed_blocks, num_new_computed_tokens,
                                        num_lookahead_tokens)
        if blocks is None and not had_slot:
            self.mamba_manager.free(request.request_id)
        return blocks

    def free(self, request: Request) -> None:
        super().free(request)
        self.mamba_manager.free(request.request_id)

    def get_state_slot(self, request_id: str) -> int | None:
        return self.mamba_manager.req_to_slot.get(request_id)


def create_kv_cache_manager(num_blocks: int, cache_config: CacheConfig) -> KVCacheManager:
    """The plain block manager, or the hybrid coordinator when the model has state layers
    (``cache_config.num_state_slots > 0``)."""
    if cache_config.num_state_slots > 0:
        return HybridKVCacheCoordinator(num_blocks, cache_config.block_size, cache_config.num_state_slots,
                                        cache_config.attention_free)
    return KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
