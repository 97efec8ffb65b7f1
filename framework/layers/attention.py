"""The paged attention layer models use; the platform's backend does the work."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.selector import get_attn_backend
from tokenmill.forward_context import get_forward_context


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    Reads the step's metadata from the forward context; its ``kv_cache`` tensor is bound by the model runner.

    Args:
        num_heads: query heads on this rank.
        head_size: D.
        scale: softmax scale.
        num_kv_heads: key/value heads on this rank.
        prefix: the layer's unique name (e.g. ``model.layers.3.self_attn.attn``).
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, prefix: str = "") -> None:
        super().__init__()
        self.layer_name = prefix
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.impl = get_attn_backend().get_impl_cls()(num_heads, head_size, scale, num_kv_heads)
        self.kv_cache = torch.empty(0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``query`` ``[T, Hq*D]``, ``key``/``value`` ``[T, Hkv*D]`` -> ``[T, Hq*D]``."""
        md = get_forward_context().attn_metadata
        return self.impl.forward(query, key, value, self.kv_cache, md)
