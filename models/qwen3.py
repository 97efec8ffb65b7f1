"""Qwen3 (Qwen team 2025): RMSNorm on each query and key head before RoPE, explicit ``head_dim``, no q/k/v
bias by default (``attention_bias``)."""

from __future__ import annotations

from typing import Any

from tokenmill.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP, attention_args


def qwen3_attention(config: Any, layer_idx: int, prefix: str) -> DecoderAttention:
    return DecoderAttention(**attention_args(config, layer_idx, f"{prefix}.self_attn", qk_norm="per_head"))


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        super().__init__(
            qwen3_attention(config, layer_idx, prefix),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act),
            cfg.hidden_size,
            cfg.rms_norm_eps,
        )


class Qwen3ForCausalLM(DecoderForCausalLM):
    layer_type = Qwen3DecoderLayer
