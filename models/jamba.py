"""Jamba (AI21 2024, transformers' ``JambaForCausalLM``): Mamba-1 layers with RMS-normalised time step, ``B`` and
``C``, and attention layers without positional encoding, one every ``attn_layer_period`` layers (at
``attn_layer_offset``); each followed by a SwiGLU MLP or, every ``expert_layer_period`` layers (at
``expert_layer_offset``), a top-k MoE whose softmax weights are not renormalised."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import (
    DecoderAttention,
    DecoderForCausalLM,
    GatedMLP,
    RMSNorm,
    SparseMoeBlock,
    attention_args,
)
from tokenmill.layers.mamba import MambaMixer
from tokenmill.models.granitemoehybrid import input_norm


def jamba_mixer(cfg: Any) -> MambaMixer:
    """The Mamba-1 mixer of a ``JambaConfig`` (``mamba_*`` fields; ``mamba_expand * hidden_size`` channels)."""
    return MambaMixer(
        cfg.hidden_size, cfg.mamba_d_state, cfg.mamba_d_conv, int(cfg.mamba_expand * cfg.hidden_size),
        int(cfg.mamba_dt_rank), use_conv_bias=bool(cfg.mamba_conv_bias), use_bias=bool(cfg.mamba_proj_bias),
        use_rms_norm=True, rms_norm_eps=float(cfg.rms_norm_eps), activation=cfg.hidden_act,
    )


class JambaDecoderLayer(nn.Module):
    """``mamba`` or ``self_attn``, then ``feed_forward`` (MLP or MoE), pre-norm (``input_layernorm``,
    ``pre_ff_layernorm``); the residual adds fused into the norms."""

    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = config.hf_config
        hidden, eps = cfg.hidden_size, float(cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.self_attn: DecoderAttention | None = None
        self.mamba: MambaMixer | None = None
        if cfg.layers_block_type[layer_idx] == "attention":
            self.self_attn = DecoderAttention(**attention_args(
                config, layer_idx, f"{prefix}.self_attn", rotary_emb=None, qkv_bias=False, o_bias=False))
        else:
            self.mamba = jamba_mixer(cfg)
        if cfg.layers_num_experts[layer_idx] > 1:
            self.feed_forward: nn.Module = SparseMoeBlock(
                cfg.num_experts, cfg.num_experts_per_tok, hidden, cfg.intermediate_size, renormalize=False,
                activation=cfg.hidden_act, prefix=f"{prefix}.feed_forward")
        else:
            self.feed_forward = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = input_norm(self.input_layernorm, hidden_states, residual)
        h = self.mamba(h) if self.mamba is not None else self.self_attn(positions, h)  # type: ignore[misc]
        h, residual = self.pre_ff_layernorm(h, residual)
        return self.feed_forward(h), residual


class JambaForCausalLM(DecoderForCausalLM):
    """The model contract for ``JambaConfig`` checkpoints (one rank: no tensor or pipeline parallelism)."""

    layer_type = JambaDecoderLayer
    is_hybrid: ClassVar[bool] = True
    supports_pp: ClassVar[bool] = False
    expert_weight_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    checkpoint_name_remap = {".feed_forward.router.": ".feed_forward.gate.", "model.final_layernorm.": "model.norm."}
