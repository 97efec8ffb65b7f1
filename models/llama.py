"""Llama (Touvron et al. 2023) and Llama-layout models, on the shared decoder blocks of ``tokenmill.layers``."""

from __future__ import annotations

from typing import Any

from tokenmill.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP, attention_args


class LlamaDecoderLayer(DecoderLayer):
    """Pre-norm layer: rotary attention (``attention_bias`` on q/k/v and o) and a SwiGLU MLP (``mlp_bias``)."""

    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        super().__init__(
            DecoderAttention(**attention_args(config, layer_idx, f"{prefix}.self_attn")),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"),
                     bias=bool(getattr(cfg, "mlp_bias", False))),
            cfg.hidden_size,
            cfg.rms_norm_eps,
        )


class LlamaForCausalLM(DecoderForCausalLM):
    """The model contract of ``tokenmill.models``: ``config.hf_config`` is a transformers LlamaConfig (or
    compatible)."""

    layer_type = LlamaDecoderLayer
