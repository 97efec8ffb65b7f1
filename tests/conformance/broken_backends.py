"""Deliberately broken attention backends: the conformance kit must fail them, naming the contract item."""

from __future__ import annotations

import dataclasses

import torch

from tokenmill.attention.kv_cache_quant import row_scales
from tokenmill.plugin_api import TorchPagedAttentionBackend, TorchPagedAttentionImpl


class WrongScaleImpl(TorchPagedAttentionImpl):
    """Ignores the softmax scale it is given and uses ``head_size ** -0.5`` (right only for the default)."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, **options):  # noqa: ANN001
        super().__init__(num_heads, head_size, head_size**-0.5, num_kv_heads, **options)


class WrongScaleBackend(TorchPagedAttentionBackend):
    name = "WRONG_SCALE"

    @staticmethod
    def get_impl_cls():  # noqa: ANN205
        return WrongScaleImpl


class OffByOneSlotImpl(TorchPagedAttentionImpl):
    """Writes every key/value one slot too far (``slot_mapping + 1``), then reads through the block table."""

    def forward(self, query, key, value, kv_cache, attn_metadata):  # noqa: ANN001, ANN201
        if attn_metadata is not None:
            attn_metadata = dataclasses.replace(attn_metadata, slot_mapping=attn_metadata.slot_mapping + 1)
        return super().forward(query, key, value, kv_cache, attn_metadata)


class OffByOneSlotBackend(TorchPagedAttentionBackend):
    name = "OFF_BY_ONE_SLOT"

    @staticmethod
    def get_impl_cls():  # noqa: ANN205
        return OffByOneSlotImpl


class LeakyEncoderImpl(TorchPagedAttentionImpl):
    """Bidirectional attention over the whole step as one sequence: tokens see other sequences' tokens."""

    def forward_encoder(self, query, key, value, attn_metadata):  # noqa: ANN001, ANN201
        return super().forward_encoder(query, key, value, None)


class LeakyEncoderBackend(TorchPagedAttentionBackend):
    name = "LEAKY_ENCODER"

    @staticmethod
    def get_impl_cls():  # noqa: ANN205
        return LeakyEncoderImpl


class CausalOnlyImpl(TorchPagedAttentionImpl):
    """Declares ``supports_mm_prefix`` (inherited) but drops ``mm_prefix_ranges``: image tokens stay causal."""

    def forward(self, query, key, value, kv_cache, attn_metadata):  # noqa: ANN001, ANN201
        md = attn_metadata and dataclasses.replace(attn_metadata, mm_prefix_ranges=None)
        return super().forward(query, key, value, kv_cache, md)


class CausalOnlyBackend(TorchPagedAttentionBackend):
    name = "CAUSAL_ONLY"

    @staticmethod
    def get_impl_cls():  # noqa: ANN205
        return CausalOnlyImpl


class UnscaledInt8Impl(TorchPagedAttentionImpl):
    """Stores an int8 cache's codes but sets every row's scale to 1 (as if the scales were never written)."""

    def write_kv(self, k, v, kv_cache, slot_mapping):  # noqa: ANN001, ANN201
        super().write_kv(k, v, kv_cache, slot_mapping)
        if kv_cache.dtype == torch.int8:
            row_scales(kv_cache).fill_(1.0)


class UnscaledInt8Backend(TorchPagedAttentionBackend):
    name = "UNSCALED_INT8"

    @staticmethod
    def get_impl_cls():  # noqa: ANN205
        return UnscaledInt8Impl
