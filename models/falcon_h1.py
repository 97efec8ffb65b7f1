"""Falcon-H1 (TII 2025, transformers' ``FalconH1ForCausalLM``): every layer runs a Mamba2 mixer and rotary
attention side by side on the same normalised input and adds their outputs, then a SwiGLU MLP; muP multipliers
everywhere (embeddings, the mixer's input and each section of its projection, attention input, keys and output,
the MLP's gate and down projections, the logits)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import (
    DecoderAttention,
    DecoderForCausalLM,
    MergedColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    attention_args,
)
from tokenmill.layers.mamba import MambaMixer2
from tokenmill.models.granitemoehybrid import input_norm


def falcon_h1_mixer(cfg: Any) -> MambaMixer2:
    """The Mamba2 mixer of a ``FalconH1Config`` (``mamba_d_ssm`` or ``mamba_expand * hidden`` channels)."""
    inner = int(cfg.mamba_d_ssm) if cfg.mamba_d_ssm is not None else int(cfg.mamba_expand * cfg.hidden_size)
    return MambaMixer2(
        cfg.hidden_size, cfg.mamba_d_state, cfg.mamba_d_conv, inner, cfg.mamba_n_heads, int(cfg.mamba_d_head),
        cfg.mamba_n_groups, use_conv_bias=bool(cfg.mamba_conv_bias), use_bias=bool(cfg.mamba_proj_bias),
        rms_norm_eps=float(cfg.rms_norm_eps), chunk_size=int(cfg.mamba_chunk_size),
        time_step_limit=tuple(cfg.time_step_limit or (0.0, float("inf"))), activation=cfg.hidden_act,
        norm_before_gate=bool(cfg.mamba_norm_before_gate), use_rms_norm=bool(cfg.mamba_rms_norm),
        in_multiplier=float(cfg.ssm_in_multiplier), proj_multipliers=list(cfg.ssm_multipliers or [1.0] * 5),
    )


class FalconH1MLP(nn.Module):
    """``down(up(x) * silu(gate(x) * gate_multiplier)) * down_multiplier`` (``mlp_multipliers``)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act: Falcon-H1 is supported with 'silu', got {cfg.hidden_act!r}")
        self.gate_multiplier, self.down_multiplier = (float(m) for m in cfg.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    """``x + mamba(n) * ssm_out + attn(n * attn_in) * attn_out`` with ``n = input_layernorm(x)``, then
    ``+ feed_forward(pre_ff_layernorm(.))``; residual adds fused into the norms."""

    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = config.hf_config
        # Falcon-H1's checkpoints set head_dim apart from hidden_size / heads (64 or 128 for all of them)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # keys scaled by key_multiplier == scores scaled by it (values and the cached keys' use are unchanged)
        self.self_attn = DecoderAttention(**attention_args(
            config, layer_idx, f"{prefix}.self_attn", scale=head_dim ** -0.5 * float(cfg.key_multiplier)))
        self.mamba = falcon_h1_mixer(cfg)
        self.feed_forward = FalconH1MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, float(cfg.rms_norm_eps))
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, float(cfg.rms_norm_eps))
        self.attention_in_multiplier = float(cfg.attention_in_multiplier)
        self.attention_out_multiplier = float(cfg.attention_out_multiplier)
        self.ssm_out_multiplier = float(cfg.ssm_out_multiplier)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = input_norm(self.input_layernorm, hidden_states, residual)
        mixed = self.mamba(h) * self.ssm_out_multiplier
        attn = self.self_attn(positions, h * self.attention_in_multiplier) * self.attention_out_multiplier
        h, residual = self.pre_ff_layernorm(mixed + attn, residual)
        return self.feed_forward(h), residual


class FalconH1ForCausalLM(DecoderForCausalLM):
    """The model contract for ``FalconH1Config`` checkpoints (one rank: no tensor or pipeline parallelism)."""

    layer_type = FalconH1DecoderLayer
    is_hybrid: ClassVar[bool] = True
    supports_pp: ClassVar[bool] = False
    checkpoint_name_remap = {"model.final_layernorm.": "model.norm."}

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__(config, prefix)
        self.lm_head_multiplier = float(config.hf_config.lm_head_multiplier)

    def model_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(embedding_multiplier=float(hf_config.embedding_multiplier))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) * self.lm_head_multiplier
