"""Nemotron-H (NVIDIA 2025, transformers' ``NemotronHForCausalLM``; Nemotron-H 4B to 56B, Nemotron Nano 2,
Nemotron 3 Nano): every block is ``x + mixer(norm(x))`` with exactly one mixer, picked per layer by
``layers_block_type`` (older configs: ``hybrid_override_pattern``, ``M`` / ``*`` / ``-`` / ``E``):

* ``linear_attention`` (``M``): a Mamba2 mixer (``mamba_num_heads * mamba_head_dim`` channels, grouped gated
  RMSNorm);
* ``full_attention`` (``*``): attention without positional encoding and without biases;
* ``mlp`` (``-``): ``down(relu(up(x)) ** 2)``, no gate;
* ``moe`` (``E``): routed experts without a gate (``relu2``) chosen by sigmoid scores with a correction bias and
  expert groups (DeepSeek-V3's router), times ``routed_scaling_factor``, plus a shared expert; with
  ``moe_latent_size`` the experts run in a smaller latent width between two projections.

Parameter names as transformers' (``model.embeddings``, ``model.layers.<i>.{norm,mixer}``, ``model.norm_f``);
NVIDIA's checkpoints say ``backbone.`` and store experts one by one (``mixer.experts.<e>.up_proj.weight``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import (
    MLP,
    DecoderAttention,
    DecoderForCausalLM,
    FusedMoE,
    ReplicatedLinear,
    RMSNorm,
    attention_args,
)
from tokenmill.layers.mamba import MambaMixer2
from tokenmill.layers.moe_routing import grouped_topk
from tokenmill.models.granitemoehybrid import input_norm


def nemotron_h_mixer(cfg: Any) -> MambaMixer2:
    """The Mamba2 mixer of a ``NemotronHConfig`` (``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``,
    ``n_groups``, ``conv_kernel``; ``use_bias`` on its projections, as transformers reads it)."""
    return MambaMixer2(
        cfg.hidden_size, cfg.ssm_state_size, cfg.conv_kernel, cfg.mamba_num_heads * cfg.mamba_head_dim,
        cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, use_conv_bias=bool(cfg.use_conv_bias),
        use_bias=bool(cfg.use_bias), rms_norm_eps=float(cfg.layer_norm_epsilon), chunk_size=int(cfg.chunk_size),
        time_step_limit=tuple(cfg.time_step_limit), activation=cfg.mamba_hidden_act,
    )


class NemotronHRouter(nn.Module):
    """The router's ``weight [E, H]`` and ``e_score_correction_bias [E]``, float32 whatever the model dtype (as
    transformers keeps them); ``forward``: ``[T, H]`` -> float32 logits ``[T, E]``."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states.float(), self.weight)


class NemotronHMoE(nn.Module):
    """``fc2(experts(fc1(x))) + shared_experts(x)`` with the experts routed by :func:`grouped_topk`."""

    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__()
        hidden, latent = cfg.hidden_size, cfg.moe_latent_size
        bias = bool(cfg.mlp_bias)
        self.top_k = int(cfg.num_experts_per_tok)
        self.num_expert_group, self.topk_group = int(cfg.n_group), int(cfg.topk_group)
        self.renormalize = bool(cfg.norm_topk_prob)
        self.routed_scaling_factor = float(cfg.routed_scaling_factor)
        self.gate = NemotronHRouter(cfg.n_routed_experts, hidden)
        self.experts = FusedMoE(cfg.n_routed_experts, self.top_k, latent or hidden, cfg.moe_intermediate_size,
                                activation=cfg.mlp_hidden_act, gated=False, prefix=f"{prefix}.experts")
        self.shared_experts = MLP(hidden, cfg.moe_shared_expert_intermediate_size, cfg.mlp_hidden_act, bias=bias)
        self.fc1_latent_proj = ReplicatedLinear(hidden, latent, bias=bias) if latent is not None else None
        self.fc2_latent_proj = ReplicatedLinear(latent, hidden, bias=bias) if latent is not None else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``."""
        weights, ids = grouped_topk(
            self.gate(hidden_states), self.top_k, correction_bias=self.gate.e_score_correction_bias,
            num_expert_group=self.num_expert_group, topk_group=self.topk_group, renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor)
        x = hidden_states if self.fc1_latent_proj is None else self.fc1_latent_proj(hidden_states)
        routed = self.experts.apply_routed(x, weights, ids)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(hidden_states)


class NemotronHBlock(nn.Module):
    """``norm`` then the layer's one ``mixer``; the residual add is fused into the next norm."""

    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = config.hf_config
        self.block_type = cfg.layers_block_type[layer_idx]
        self.norm = RMSNorm(cfg.hidden_size, float(cfg.layer_norm_epsilon))
        self.mixer: nn.Module
        if self.block_type == "linear_attention":
            self.mixer = nemotron_h_mixer(cfg)
        elif self.block_type == "full_attention":
            self.mixer = DecoderAttention(**attention_args(config, layer_idx, f"{prefix}.mixer", rotary_emb=None,
                                                           qkv_bias=False, o_bias=False))
        elif self.block_type == "mlp":
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_hidden_act, bias=bool(cfg.mlp_bias))
        elif self.block_type == "moe":
            self.mixer = NemotronHMoE(cfg, f"{prefix}.mixer")
        else:
            raise ValueError(f"layers_block_type[{layer_idx}]: unknown block type {self.block_type!r} "
                             "(linear_attention, full_attention, mlp, moe)")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = input_norm(self.norm, hidden_states, residual)
        if self.block_type == "full_attention":
            return self.mixer(positions, h), residual
        return self.mixer(h), residual


class NemotronHForCausalLM(DecoderForCausalLM):
    """The model contract for ``NemotronHConfig`` checkpoints (one rank: no tensor or pipeline parallelism;
    multi-token-prediction weights, ``mtp.*``, are not used)."""

    layer_type = NemotronHBlock
    is_hybrid: ClassVar[bool] = True
    supports_pp: ClassVar[bool] = False
    expert_weight_names = {"up_proj": "w3", "down_proj": "w2"}
    checkpoint_name_remap = {"backbone.": "model.", "model.embeddings.": "model.embed_tokens.",
                             "model.norm_f.": "model.norm."}

    def model_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(norm_eps=float(hf_config.layer_norm_epsilon))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, t) for n, t in weights if not n.startswith("mtp."))
