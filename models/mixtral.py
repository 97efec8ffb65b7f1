"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): the Mistral layout with a sparse MoE MLP on every layer:
softmax router, top-``num_experts_per_tok`` of ``num_local_experts`` experts, weights renormalised."""

from __future__ import annotations

from typing import Any

from tokenmill.layers import DecoderAttention, DecoderForCausalLM, DecoderLayer, SparseMoeBlock, attention_args


class MixtralDecoderLayer(DecoderLayer):
    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        cfg = config.hf_config
        moe = SparseMoeBlock(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                             renormalize=True, activation=cfg.hidden_act, prefix=f"{prefix}.mlp")
        super().__init__(DecoderAttention(**attention_args(config, layer_idx, f"{prefix}.self_attn")), moe,
                         cfg.hidden_size, cfg.rms_norm_eps)


class MixtralForCausalLM(DecoderForCausalLM):
    """Checkpoint names ``block_sparse_moe.gate`` / ``block_sparse_moe.experts.<e>.w1|w2|w3`` (or transformers'
    fused ``experts.gate_up_proj`` / ``experts.down_proj``) load into ``mlp.gate`` / ``mlp.experts``."""

    layer_type = MixtralDecoderLayer
    checkpoint_name_remap = {".block_sparse_moe.": ".mlp."}
    expert_weight_names = {"w1": "w1", "w2": "w2", "w3": "w3"}
