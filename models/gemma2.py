"""Gemma 2 (Gemma Team 2024): four ``(1 + w)`` RMSNorms per layer, GeGLU MLP, embeddings scaled by
``sqrt(hidden_size)`` in the model dtype, softmax scale ``query_pre_attn_scalar ** -0.5``, attention and final
logit soft caps, sliding window on the layers ``layer_types`` marks."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP, attention_args

GEMMA_NORM = dict(norm_offset=1.0, norm_in_float32=True)


def gemma_activation(cfg: Any) -> str:
    return getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh"


def gemma_embedding_multiplier(cfg: Any) -> float:
    """``sqrt(hidden_size)`` rounded to the model dtype (the default dtype while the model is built), as
    Gemma's reference code multiplies by a tensor of that dtype."""
    return float(torch.tensor(cfg.hidden_size**0.5, dtype=torch.get_default_dtype()))


class Gemma2DecoderLayer(DecoderLayer):
    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        attn = DecoderAttention(**attention_args(
            config, layer_idx, f"{prefix}.self_attn",
            scale=float(cfg.query_pre_attn_scalar) ** -0.5,
            logits_soft_cap=getattr(cfg, "attn_logit_softcapping", None),
        ))
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, gemma_activation(cfg))
        super().__init__(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, norm_style="sandwich", **GEMMA_NORM)


class Gemma2ForCausalLM(DecoderForCausalLM):
    layer_type = Gemma2DecoderLayer

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__(config, prefix)
        self.final_logit_softcap = getattr(config.hf_config, "final_logit_softcapping", None)

    def model_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(embedding_multiplier=gemma_embedding_multiplier(hf_config), **GEMMA_NORM)
