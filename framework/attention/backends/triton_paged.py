"""Paged attention with Triton kernels (portable: NVIDIA and AMD GPUs; CPU under ``TRITON_INTERPRET=1``).

KV cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys, then values; an int8
cache's rows are wider, ``kv_cache_quant.kv_cache_row_size``, and quantized caches are read back in the kernel);
the torch backend keeps heads outermost instead. One kernel writes the step's new keys/values into their slots (``slot_mapping``); a second attends over the
paged cache for the whole flattened batch in one launch: prefill chunks (with or without a cached prefix)
and decodes mixed, grouped-query attention, causal (optionally sliding-window and soft-capped), no padding. The kernels live in
:mod:`tokenmill.attention.ops.triton_paged_attention` (FlashAttention-2 online softmax over KV blocks,
Dao 2023; paging after Kwon et al. 2023).

Triton is imported lazily (when an impl is created), so this module imports where triton is missing.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from tokenmill.attention.encoder_batches import sequence_ranges


def triton_available() -> bool:
    """Whether ``import triton`` can work here (looks the package up without importing it)."""
    return importlib.util.find_spec("triton") is not None


class TritonPagedAttentionBackend(AttentionBackend):
    name = "TRITON_PAGED"
    supports_graph_capture = True  # device metadata only; grid fixed by the batch shape
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_encoder_only = True
    supported_quantized_kv_cache_dtypes = ("int8", "fp8_e4m3", "fp8_e5m2")  # see triton_paged_attention

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonPagedAttentionImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class TritonPagedAttentionImpl(AttentionImpl):
    """Attention layer state for :class:`TritonPagedAttentionBackend`.

    Raises:
        ImportError: triton is not installed (the message says which backend to use instead).
    """

    # Same signature as AttentionImpl.__init__: every impl takes the backend's constructor arguments.
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap)
        try:
            from tokenmill.attention.ops import triton_paged_attention as ops
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"the TRITON_PAGED attention backend needs triton ({exc}); install it (`pip install triton`) "
                "or use the TORCH_PAGED backend"
            ) from exc
        self._ops = ops

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """See :meth:`AttentionImpl.forward`. ``query`` ``[T, Hq*D]``, ``key``/``value`` ``[T, Hkv*D]``,
        ``kv_cache`` ``[2, num_blocks, block_size, Hkv, D]`` -> ``[T, Hq*D]`` in ``query``'s dtype."""
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        if attn_metadata is None:
            return self._causal_sdpa(q, k, v).reshape(num_tokens, -1)
        n = attn_metadata.num_actual_tokens
        self._ops.reshape_and_cache(k[:n], v[:n], kv_cache, attn_metadata.slot_mapping[:n])
        out = torch.empty_like(q) if n == num_tokens else torch.zeros_like(q)
        self._ops.paged_attention(
            q[:n],
            kv_cache,
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            self.scale,
            attn_metadata.max_query_len,
            out=out[:n],
            sliding_window=self.sliding_window,
            soft_cap=self.logits_soft_cap,
        )
        return out.reshape(num_tokens, -1)

    def forward_encoder(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        """Bidirectional attention within each whole sequence of the step (encoder models), no KV cache: see
        ``TorchPagedAttentionImpl.forward_encoder``. ``[T, Hq*D]`` -> ``[T, Hq*D]`` in ``query``'s dtype.

        Raises:
            ValueError: a sequence continues a previous step (chunked prefill).
        """
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        ranges = sequence_ranges(attn_metadata, num_tokens)
        if attn_metadata is None:  # profiling pass: one sequence, no device metadata
            qsl = torch.tensor([0, num_tokens], dtype=torch.int32, device=query.device)
            seq_lens, longest = qsl[1:], num_tokens
        else:
            qsl, seq_lens, longest = attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.max_seq_len
        out = torch.empty_like(q) if ranges and ranges[-1][1] == num_tokens else torch.zeros_like(q)
        self._ops.encoder_attention(q, k, v, qsl, seq_lens, self.scale, longest, out=out)
        return out.reshape(num_tokens, -1)

    def _causal_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Dummy/profiling run: causal attention over the batch as one sequence, ``[T, H, D]`` layouts."""
        if self.sliding_window is not None or self.logits_soft_cap is not None:
            from tokenmill.attention.backends.torch_paged import TorchPagedAttentionImpl

            ref = TorchPagedAttentionImpl(self.num_heads, self.head_size, self.scale, self.num_kv_heads,
                                          self.sliding_window, self.logits_soft_cap)
            return ref._sdpa(q, k, v, causal_offset=0)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.transpose(0, 1)
