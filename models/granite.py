"""Granite 3 (IBM 2024): the Llama layout with four multipliers: ``embedding_multiplier`` on the embeddings,
``attention_multiplier`` as the softmax scale, ``residual_multiplier`` on each sublayer's output and logits
divided by ``logits_scaling``."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP, attention_args


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        attn = DecoderAttention(**attention_args(config, layer_idx, f"{prefix}.self_attn",
                                                 scale=float(cfg.attention_multiplier)))
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=bool(cfg.mlp_bias))
        super().__init__(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps,
                         residual_multiplier=float(cfg.residual_multiplier))


class GraniteForCausalLM(DecoderForCausalLM):
    layer_type = GraniteDecoderLayer

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__(config, prefix)
        self.logits_scaling = float(config.hf_config.logits_scaling)

    def model_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(embedding_multiplier=float(hf_config.embedding_multiplier))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.logits_scaling
