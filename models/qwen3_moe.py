"""Qwen3-MoE (Qwen team 2025): Qwen3's attention with a sparse MoE MLP (``moe_intermediate_size`` experts,
renormalised top-k when ``norm_topk_prob``) on the layers ``decoder_sparse_step`` selects, dense MLPs
(``intermediate_size``) on ``mlp_only_layers``, as in transformers."""

from __future__ import annotations

from typing import Any

from tokenmill.layers import DecoderForCausalLM, DecoderLayer, GatedMLP, SparseMoeBlock
from tokenmill.models.qwen3 import qwen3_attention


def is_sparse_layer(cfg: Any, layer_idx: int) -> bool:
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    only_mlp = getattr(cfg, "mlp_only_layers", None) or []
    return layer_idx not in only_mlp and cfg.num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeDecoderLayer(DecoderLayer):
    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        if is_sparse_layer(cfg, layer_idx):
            mlp = SparseMoeBlock(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                 renormalize=bool(cfg.norm_topk_prob), activation=cfg.hidden_act,
                                 prefix=f"{prefix}.mlp")
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        super().__init__(qwen3_attention(config, layer_idx, prefix), mlp, cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    layer_type = Qwen3MoeDecoderLayer
    expert_weight_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
