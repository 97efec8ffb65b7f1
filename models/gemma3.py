"""Gemma 3, text model (Gemma Team 2025): Gemma 2's layout without the attention soft cap by default, plus
``(1 + w)`` RMSNorm on each query and key head and separate rope parameters for local (sliding) and global
layers (``rope_parameters`` keyed by layer type: ``rope_local_base_freq`` vs ``rope_theta`` + scaling)."""

from __future__ import annotations

from typing import Any

from tokenmill.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP, attention_args
from tokenmill.models.gemma2 import GEMMA_NORM, gemma_activation, gemma_embedding_multiplier


# Gemma 2's layer plus q/k norms; written out so each family's layer reads whole in its own file.
class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        attn = DecoderAttention(**attention_args(
            config, layer_idx, f"{prefix}.self_attn",
            scale=float(cfg.query_pre_attn_scalar) ** -0.5,
            logits_soft_cap=getattr(cfg, "attn_logit_softcapping", None),
            qk_norm="per_head", norm_offset=1.0, norm_in_float32=True,
        ))
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, gemma_activation(cfg))
        super().__init__(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, norm_style="sandwich", **GEMMA_NORM)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Raises (constructor): ValueError for ``use_bidirectional_attention`` (embedding variants)."""

    layer_type = Gemma3DecoderLayer

    def __init__(self, config: Any, prefix: str = "") -> None:
        if getattr(config.hf_config, "use_bidirectional_attention", False):
            raise ValueError("Gemma3ForCausalLM: use_bidirectional_attention=True is not supported (causal only)")
        super().__init__(config, prefix)
        self.final_logit_softcap = getattr(config.hf_config, "final_logit_softcapping", None)

    def model_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(embedding_multiplier=gemma_embedding_multiplier(hf_config), **GEMMA_NORM)
