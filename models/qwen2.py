"""Qwen2 / Qwen2.5 / QwQ (Qwen team 2024): Llama layout with biases on the q/k/v projections only, and a
sliding window on the layers ``layer_types`` marks (``use_sliding_window``, ``max_window_layers``)."""

from __future__ import annotations

from typing import Any

from tokenmill.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP, attention_args


class Qwen2DecoderLayer(DecoderLayer):
    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        super().__init__(
            DecoderAttention(**attention_args(config, layer_idx, f"{prefix}.self_attn", qkv_bias=True, o_bias=False)),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act),
            cfg.hidden_size,
            cfg.rms_norm_eps,
        )


class Qwen2ForCausalLM(DecoderForCausalLM):
    layer_type = Qwen2DecoderLayer
