"""AttentionBackend / AttentionImpl / AttentionMetadata: the contract between attention layers and kernels.

A backend owns the per-layer KV-cache layout and the kernels that write new keys/values into cache slots and
attend over the paged cache for a flattened batch (prefill chunks and decodes mixed, no padding).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step description of the flattened batch of ``B`` requests and ``T`` tokens.

    Attributes:
        num_actual_tokens: T.
        query_start_loc: ``[B + 1]`` int32, where each request's tokens start in the batch (last = T).
        seq_lens: ``[B]`` int32, each request's length after this step (cached + new tokens).
        block_table: ``[B, max_blocks]`` int32, KV block ids of each request (padding unspecified).
        slot_mapping: ``[T]`` int64, cache slot (``block_id * block_size + offset``) of each new token.
        max_query_len: longest query (new tokens) of a request.
        max_seq_len: longest ``seq_lens`` entry.
        query_start_loc_cpu: host copy of ``query_start_loc`` (list of ints).
        seq_lens_cpu: host copy of ``seq_lens``.
        block_size: tokens per block.
        mm_prefix_ranges: ``None``, or per request the ``(start, end)`` sequence positions (end exclusive) of
            spans whose tokens attend to each other in both directions on top of the causal (and sliding-window)
            mask: vLLM's multimodal prefix-LM ranges, one per run of an image's embedding tokens (Gemma 3).
            Key ``k`` is visible to query ``q`` when ``k <= q`` or both lie in one span, and, with a sliding
            window ``W``, ``k > q - W`` (transformers' Gemma 3 mask). Only backends that declare
            ``supports_mm_prefix`` get it. The scheduler never ends a prefill chunk inside a span (the keys
            after a chunk do not exist yet), so a span's later tokens are always in the same step as its
            queries or, after a prefix-cache hit inside the span, its earlier keys in the cache.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    mm_prefix_ranges: list[list[tuple[int, int]]] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionImpl(ABC):
    """One attention layer's kernel state.

    Args:
        num_heads: query heads on this rank.
        head_size: D.
        scale: softmax scale (usually ``D ** -0.5``).
        num_kv_heads: key/value heads on this rank (grouped-query attention when fewer than ``num_heads``).
        sliding_window: ``W`` tokens or ``None``: query at position ``i`` sees keys ``j`` with
            ``i - W < j <= i`` (transformers' sliding-window mask, Mistral / Gemma / Qwen2 ``sliding_window``).
            A backend that sets ``supports_sliding_window`` never reads cache blocks wholly outside the window.
        logits_soft_cap: ``c`` or ``None``: scores become ``c * tanh(score / c)`` after scaling, before the
            mask (Gemma 2's ``attn_logit_softcapping``).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """Write ``key``/``value`` into their slots, then attend.

        Args:
            query: ``[T, num_heads * D]``.
            key, value: ``[T, num_kv_heads * D]``.
            kv_cache: this layer's cache in the backend's layout.
            attn_metadata: the step's metadata; ``None`` means a dummy run (causal attention over the batch
                as one sequence, no cache).

        Returns:
            ``[T, num_heads * D]`` in the query's dtype.
        """


class AttentionBackend(ABC):
    """A family of attention kernels and the KV-cache layout they read.

    Attributes:
        name: the backend's name.
        supports_graph_capture: the impl reads only device tensors of :class:`AttentionMetadata` (never
            ``query_start_loc_cpu`` / ``seq_lens_cpu``, whose values are placeholders in a captured graph) and
            launches the same kernels for the same shapes, so a decode step can be captured once as a device
            graph and replayed with new contents in the same buffers.
        supports_compile: for a decode-only step (``max_query_len == 1``) the impl reads only device tensors
            of :class:`AttentionMetadata` plus ``max_query_len`` and ``block_size``, so ``torch.compile`` can
            trace it once with dynamic batch size and block-table width (see ``tokenmill.worker.compiled_runner``).
        supports_sliding_window: the impl takes ``sliding_window`` (see :class:`AttentionImpl`).
        supports_logits_soft_cap: the impl takes ``logits_soft_cap``.
        supports_encoder_only: the impl has ``forward_encoder(query, key, value, attn_metadata)``:
            bidirectional attention within each (whole) sequence of the step, for encoder models.
        supports_mm_prefix: the impl honours :attr:`AttentionMetadata.mm_prefix_ranges` (bidirectional
            attention within an image's tokens, Gemma 3's vision model); models that need it run on another
            backend (see :func:`tokenmill.attention.selector.select_attn_backend`).
        supported_quantized_kv_cache_dtypes: the quantized ``--kv-cache-dtype`` names (``"int8"``,
            ``"fp8_e4m3"``, ``"fp8_e5m2"``) whose caches the impl writes and reads, rows as
            :mod:`tokenmill.attention.kv_cache_quant` defines them; any other is refused at start-up.
    """

    name: str = ""
    supports_graph_capture: bool = False
    supports_compile: bool = False
    supports_sliding_window: bool = False
    supports_logits_soft_cap: bool = False
    supports_encoder_only: bool = False
    supports_mm_prefix: bool = False
    supported_quantized_kv_cache_dtypes: tuple[str, ...] = ()

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @classmethod
    def wait_until_ready(cls) -> None:
        """Block until kernels the backend builds or loads in the background are usable. Called before a
        forward pass is compiled (the trace must see the kernels the steps will run) and before compiled graphs
        that call them are loaded; eager steps never wait. Default: nothing to wait for."""

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor, ``head_size`` being the elements of one (token, KV head) row:
        the model's head size, or ``kv_cache_quant.kv_cache_row_size`` of it for a quantized cache."""
