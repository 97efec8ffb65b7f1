"""Qwen3-Next (Qwen team 2025, transformers' ``Qwen3NextForCausalLM``): gated DeltaNet layers (``linear_attn``)
and gated attention layers (``self_attn``) as ``layer_types`` lists them; the attention's ``q_proj`` also gives a
per-channel output gate (``sigmoid``), with ``(1 + w)`` q/k norms per head and partial RoPE; MoE with a shared
expert scaled by ``sigmoid(shared_expert_gate(x))`` (dense MLPs on ``mlp_only_layers``); every norm is
``(1 + w)`` in float32."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.layers import DecoderForCausalLM, GatedMLP, ReplicatedLinear, RMSNorm, SparseMoeBlock, attention_args
from tokenmill.layers.attention import Attention
from tokenmill.layers.mamba import GatedDeltaNet
from tokenmill.models.granitemoehybrid import input_norm
from tokenmill.models.qwen3_moe import is_sparse_layer


def zero_centered_norm(size: int, eps: float) -> RMSNorm:
    """Qwen3-Next's RMSNorm: ``norm(x) * (1 + w)`` in float32 (weights stored as deltas from one)."""
    return RMSNorm(size, eps, offset=1.0, multiply_in_float32=True)


class Qwen3NextAttention(nn.Module):
    """Gated attention: ``o_proj(attn(q, k, v) * sigmoid(gate))`` where ``q_proj`` gives ``q`` and ``gate``
    interleaved per head (``[H, 2 * head_dim]``)."""

    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = config.hf_config
        args = attention_args(config, layer_idx, prefix)
        self.num_heads, self.num_kv_heads, self.head_dim = args["num_heads"], args["num_kv_heads"], args["head_dim"]
        bias = bool(getattr(cfg, "attention_bias", False))
        hidden = cfg.hidden_size
        self.q_proj = ReplicatedLinear(hidden, 2 * self.num_heads * self.head_dim, bias=bias)
        self.k_proj = ReplicatedLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = ReplicatedLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = ReplicatedLinear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = zero_centered_norm(self.head_dim, float(cfg.rms_norm_eps))
        self.k_norm = zero_centered_norm(self.head_dim, float(cfg.rms_norm_eps))
        self.rotary_emb = args["rotary_emb"]
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        t = hidden_states.shape[0]
        q, gate = self.q_proj(hidden_states).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous()).reshape(t, -1)
        k = self.k_norm(self.k_proj(hidden_states).view(t, self.num_kv_heads, self.head_dim)).reshape(t, -1)
        v = self.v_proj(hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.contiguous())
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class Qwen3NextSparseMoeBlock(SparseMoeBlock):
    """Routed experts plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(self, cfg: Any, prefix: str) -> None:
        super().__init__(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                         renormalize=bool(cfg.norm_topk_prob), activation=cfg.hidden_act, prefix=prefix)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
        self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return super().forward(hidden_states) + shared


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, prefix: str) -> None:
        super().__init__()
        cfg = config.hf_config
        eps = float(cfg.rms_norm_eps)
        self.input_layernorm = zero_centered_norm(cfg.hidden_size, eps)
        self.post_attention_layernorm = zero_centered_norm(cfg.hidden_size, eps)
        self.self_attn: Qwen3NextAttention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if cfg.layer_types[layer_idx] == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                             cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                             cfg.linear_conv_kernel_dim, rms_norm_eps=eps, activation=cfg.hidden_act)
        else:
            self.self_attn = Qwen3NextAttention(config, layer_idx, f"{prefix}.self_attn")
        if is_sparse_layer(cfg, layer_idx):
            self.mlp: nn.Module = Qwen3NextSparseMoeBlock(cfg, f"{prefix}.mlp")
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = input_norm(self.input_layernorm, hidden_states, residual)
        h = self.linear_attn(h) if self.linear_attn is not None else self.self_attn(positions, h)  # type: ignore[misc]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """The model contract for ``Qwen3NextConfig`` checkpoints (one rank: no tensor or pipeline parallelism;
    multi-token-prediction weights, ``mtp.*``, are not used)."""

    layer_type = Qwen3NextDecoderLayer
    is_hybrid: ClassVar[bool] = True
    supports_pp: ClassVar[bool] = False
    expert_weight_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def model_kwargs(self, hf_config: Any) -> dict[str, Any]:
        return dict(norm_offset=1.0, norm_in_float32=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, t) for n, t in weights if not n.startswith("mtp."))
