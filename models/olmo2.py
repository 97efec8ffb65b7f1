"""OLMo 2 (OLMo Team 2024): RMSNorm over the whole query and key projections (split over tensor-parallel ranks)
and norms after each sublayer instead of before (``post_attention_layernorm``, ``post_feedforward_layernorm``)."""

from __future__ import annotations

from typing import Any

from tokenmill.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP, attention_args


class Olmo2DecoderLayer(DecoderLayer):
    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        attn = DecoderAttention(**attention_args(config, layer_idx, f"{prefix}.self_attn", qk_norm="full",
                                                 norm_in_float32=True))
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        super().__init__(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, norm_style="post", norm_in_float32=True)


class Olmo2ForCausalLM(DecoderForCausalLM):
    layer_type = Olmo2DecoderLayer

    def model_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(norm_in_float32=True)
