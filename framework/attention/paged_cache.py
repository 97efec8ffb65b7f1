"""The paged KV cache's addressing, shared by every backend (layouts differ; slots do not).

The cache of one layer holds ``num_blocks`` blocks of ``block_size`` token slots. A request's block table lists
its block ids in sequence order; token ``p`` of the request lives in slot
``block_table[p // block_size] * block_size + p % block_size``. The model runner sends each step's
``slot_mapping`` (one slot per new token) and block tables in :class:`tokenmill.attention.backend.AttentionMetadata`;
a backend writes the new keys/values to ``slot_mapping`` and reads a request's context through its block table.
A negative slot (the padding rows of a captured device graph) must be written nowhere.

A backend's ``get_kv_cache_shape(..., head_size)`` takes the elements of one row; the caches are allocated with
:func:`tokenmill.attention.kv_cache_quant.kv_cache_row_size` of the model's head size (wider than ``head_size``
for an ``int8`` cache, whose rows carry their scales), so the block count at start-up counts the real bytes.
"""

from __future__ import annotations

import torch

from tokenmill.attention.kv_cache_quant import kv_cache_row_size


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers (blocks needed for ``a`` tokens of ``b`` per block)."""
    return -(-a // b)


def compute_slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of ``positions`` of one request.

    Args:
        block_table: ``[nb]`` int, the request's block ids in order.
        positions: ``[T]`` int, token positions (each ``< nb * block_size``).
        block_size: tokens per block.

    Returns:
        ``[T]`` int64 slots, ``block_table[p // block_size] * block_size + p % block_size``.
    """
    positions = positions.long()
    return block_table.long()[positions // block_size] * block_size + positions % block_size


def keeps_kv_cache(layer: object) -> bool:
    """Whether an attention layer reads or writes the paged KV cache (an ``encoder_only`` layer does neither:
    each sequence attends within its own step)."""
    return getattr(layer, "attn_type", "decoder") != "encoder_only"


def kv_cache_bytes_per_block(attn_backend: type, layers: list, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across ``layers`` (attention layers with ``num_kv_heads`` / ``head_size``) in
    ``attn_backend``'s layout (``get_kv_cache_shape``) and ``dtype`` (rows of ``kv_cache_row_size``: an ``int8``
    cache's scales included); 0 when no layer keeps a cache (:func:`keeps_kv_cache`)."""
    elements = 0
    for layer in filter(keeps_kv_cache, layers):
        row = kv_cache_row_size(layer.head_size, dtype)
        shape = attn_backend.get_kv_cache_shape(1, block_size, layer.num_kv_heads, row)
        n = 1
        for d in shape:
            n *= d
        elements += n
    return elements * torch.tensor([], dtype=dtype).element_size()


def allocate_kv_caches(attn_backend: type, layers: list, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache of ``num_blocks`` blocks per layer that keeps one (:func:`keeps_kv_cache`;
    ``Platform.allocate_kv_cache``), bound to the layer (``layer.kv_cache``); returned in layer order, each in
    ``attn_backend``'s layout and ``dtype`` (rows of ``kv_cache_row_size(head_size, dtype)`` elements).

    Raises:
        ValueError: as ``Platform.allocate_kv_cache`` (a device the platform cannot use).
    """
    from tokenmill.platforms import get_current_platform

    platform = get_current_platform()
    caches = []
    for layer in filter(keeps_kv_cache, layers):
        row = kv_cache_row_size(layer.head_size, dtype)
        shape = attn_backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, row)
        layer.kv_cache = platform.allocate_kv_cache(tuple(shape), dtype, device)
        caches.append(layer.kv_cache)
    return caches
