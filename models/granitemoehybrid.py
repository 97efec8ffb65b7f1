"""Granite 4.0-H (IBM 2025, transformers' ``GraniteMoeHybridForCausalLM``): Mamba2 layers and attention layers
as ``layer_types`` lists them, each followed by a shared SwiGLU MLP (``shared_mlp``) plus, with
``num_local_experts > 0``, a top-k MoE (``block_sparse_moe``); Granite's multipliers (embedding, attention
scale, residual, logits) and, by default, no positional encoding (``position_embedding_type`` ``None``; RoPE
when ``"rope"``)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import DecoderAttention, GatedMLP, RMSNorm, SparseMoeBlock, attention_args
from tokenmill.layers.mamba import MambaMixer2
from tokenmill.models.granite import GraniteForCausalLM

ATTENTION_LAYER_TYPES = ("attention", "full_attention")


def is_attention_layer(cfg: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` is an attention layer (``layer_types``: ``"attention"`` /
    ``"full_attention"``; ``"mamba"`` / ``"linear_attention"`` are Mamba2 layers)."""
    return cfg.layer_types[layer_idx] in ATTENTION_LAYER_TYPES


def granite_mamba_mixer(cfg: Any) -> MambaMixer2:
    """The Mamba2 mixer of a ``GraniteMoeHybridConfig`` (``mamba_*`` fields)."""
    return MambaMixer2(
        cfg.hidden_size, cfg.mamba_d_state, cfg.mamba_d_conv, int(cfg.mamba_expand * cfg.hidden_size),
        cfg.mamba_n_heads, int(cfg.mamba_d_head), cfg.mamba_n_groups, use_conv_bias=bool(cfg.mamba_conv_bias),
        use_bias=bool(cfg.mamba_proj_bias), rms_norm_eps=float(cfg.rms_norm_eps), chunk_size=int(cfg.mamba_chunk_size),
        time_step_limit=tuple(cfg.time_step_limit or (0.0, float("inf"))), activation=cfg.hidden_act,
    )


def input_norm(norm: RMSNorm, hidden_states: torch.Tensor, residual: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's first norm with the previous layer's residual add fused in: ``(norm(x [+ residual]), x [+
    residual])`` (the first layer has no residual yet)."""
    if residual is None:
        return norm(hidden_states), hidden_states
    return norm(hidden_states, residual)


class GraniteMoeHybridDecoderLayer(nn.Module):
    """``mamba`` or ``self_attn``, then ``shared_mlp`` (+ ``block_sparse_moe``), pre-norm, each sublayer's output
    scaled by ``residual_multiplier``; the residual add is fused into the next norm (as :class:`DecoderLayer`)."""

    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = config.hf_config
        hidden, eps = cfg.hidden_size, float(cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn: DecoderAttention | None = None
        self.mamba: MambaMixer2 | None = None
        if is_attention_layer(cfg, layer_idx):
            rope = {} if getattr(cfg, "position_embedding_type", None) == "rope" else {"rotary_emb": None}
            self.self_attn = DecoderAttention(**attention_args(
                config, layer_idx, f"{prefix}.self_attn", scale=float(cfg.attention_multiplier), **rope))
        else:
            self.mamba = granite_mamba_mixer(cfg)
        self.block_sparse_moe = (
            SparseMoeBlock(cfg.num_local_experts, cfg.num_experts_per_tok, hidden, cfg.intermediate_size,
                           renormalize=True, activation=cfg.hidden_act, prefix=f"{prefix}.block_sparse_moe")
            if (cfg.num_local_experts or 0) > 0 else None
        )
        self.shared_mlp = GatedMLP(hidden, cfg.shared_intermediate_size, cfg.hidden_act)
        self.residual_multiplier = float(cfg.residual_multiplier)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = input_norm(self.input_layernorm, hidden_states, residual)
        h = self.mamba(h) if self.mamba is not None else self.self_attn(positions, h)  # type: ignore[misc]
        h, residual = self.post_attention_layernorm(h * self.residual_multiplier, residual)
        out = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(h) + out
        return out * self.residual_multiplier, residual


class GraniteMoeHybridForCausalLM(GraniteForCausalLM):
    """The model contract for ``GraniteMoeHybridConfig`` checkpoints (one rank: no tensor or pipeline
    parallelism); Granite's embedding multiplier and logit scaling come from :class:`GraniteForCausalLM`."""

    layer_type = GraniteMoeHybridDecoderLayer
    is_hybrid: ClassVar[bool] = True
    supports_pp: ClassVar[bool] = False
    expert_weight_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    # IBM's checkpoints: experts as 3-D input_linear [E, 2I, H] (gate rows, then up) / output_linear [E, H, I],
    # the router as router.layer (transformers' in-memory names: router, experts.gate_up_proj / down_proj)
    checkpoint_name_remap = {
        ".block_sparse_moe.router.layer.": ".block_sparse_moe.gate.",
        ".block_sparse_moe.router.": ".block_sparse_moe.gate.",
        ".block_sparse_moe.input_linear.": ".block_sparse_moe.experts.gate_up_proj.",
        ".block_sparse_moe.output_linear.": ".block_sparse_moe.experts.down_proj.",
        ".shared_mlp.input_linear.": ".shared_mlp.gate_up_proj.",
        ".shared_mlp.output_linear.": ".shared_mlp.down_proj.",
    }
